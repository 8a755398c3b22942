"""dcsched: schedule ZeRO-3 / DeepCompile training graphs outside a live DeepSpeed job.

The flow is profile -> bundle -> schedule -> report -> replay; every stage is a
pure function usable from Python, and the ``dcsched`` command line only parses,
calls and renders. ``dcsched.capture``, ``dcsched.simulate`` and
``dcsched.schedule`` are functions; their modules are reached with
``from dcsched.simulate import compile_view`` and the like.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import ops  # noqa: F401  (registers torch.ops.dcsched.*)
from .bundle import Bundle, InputInfo, ParamInfo, load, save
from .errors import BundleError, DcschedError, GraphError, ResultMismatch
from .nxview import to_fx, to_networkx
from .roles import Role, role_of

# profile -> bundle -> schedule -> simulate -> replay
from .capture import capture, capture_script  # noqa: E402  (the function shadows its module on purpose)
from .profile import ProfileOptions, profile_bundle
from .reorder import schedule
from .simulate import SimResult, simulate  # noqa: E402  (the function shadows its module on purpose)
from .replay import replay_orders
from .train import backend, shard

__all__ = [
    "__version__",
    "Bundle", "InputInfo", "ParamInfo", "load", "save",
    "BundleError", "DcschedError", "GraphError", "ResultMismatch",
    "to_fx", "to_networkx", "Role", "role_of",
    "capture", "capture_script", "ProfileOptions", "profile_bundle",
    "schedule", "simulate", "SimResult", "replay_orders", "backend", "shard",
]
