"""dcsched: schedule ZeRO-3 / DeepCompile training graphs outside a live DeepSpeed job.

The flow is profile -> bundle -> schedule -> report -> replay; every stage is a
pure function usable from Python, and the ``dcsched`` command line only parses,
calls and renders.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import ops  # noqa: F401  (registers torch.ops.dcsched.*)
from .bundle import Bundle, InputInfo, ParamInfo, load, save
from .errors import BundleError, DcschedError, GraphError, ResultMismatch
from .nxview import to_fx, to_networkx
from .reorder import schedule
from .roles import Role, role_of

__all__ = [
    "__version__", "Bundle", "InputInfo", "ParamInfo", "load", "save",
    "BundleError", "DcschedError", "GraphError", "ResultMismatch",
    "to_fx", "to_networkx", "Role", "role_of", "schedule",
]
