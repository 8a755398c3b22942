"""dcsched: schedule ZeRO-3 / DeepCompile training graphs outside a live DeepSpeed job.

The flow is profile -> bundle -> schedule -> report -> replay -> train, one
folder each (``dcsched.profile``, ``dcsched.bundle``, ``dcsched.schedulers``,
``dcsched.report``, ``dcsched.replay``, ``dcsched.train``), over the graph
forms in ``dcsched.graph``, the simulator in ``dcsched.sim`` and the ZeRO-3
runtime in ``dcsched.runtime``. Every stage is a pure function usable from
Python, and the ``dcsched`` command line only parses, calls and renders.

The public names load on first use (:mod:`dcsched.lazy`), so ``import dcsched``
does not import torch:

>>> import dcsched
>>> dcsched.load.__module__
'dcsched.bundle.core'
"""

from __future__ import annotations

from dcsched.lazy import lazy_names

__version__ = "0.1.0"

#: Public name -> the module that defines it. Imported on first use (module ``__getattr__``), so that
#: ``import dcsched`` and ``dcsched --help`` do not pay for importing torch.
_LAZY = {
    "Bundle": "bundle.core", "InputInfo": "bundle.core", "ParamInfo": "bundle.core", "load": "bundle.core",
    "save": "bundle.core",
    "BundleError": "errors", "DcschedError": "errors", "GraphError": "errors", "ResultMismatch": "errors",
    "to_fx": "graph.nxview", "to_networkx": "graph.nxview", "Role": "graph.roles", "role_of": "graph.roles",
    "capture": "profile.capture", "capture_script": "profile.capture", "ProfileOptions": "costmodels.options",
    "profile_bundle": "profile.measure", "tracing_checkpoints": "profile.checkpointing",
    "Budget": "budget", "Plan": "plan",
    "schedule": "reorder", "simulate": "sim.simulate", "SimResult": "sim.simulate",
    "replay_orders": "replay",
    "backend": "train.backend", "shard": "train.sharding", "MixedPrecisionPolicy": "train.mixed_precision",
    "save_checkpoint": "train.checkpoint", "load_checkpoint": "train.checkpoint", "CheckpointError": "train.checkpoint",
}


def _register_ops() -> None:
    import importlib
    importlib.import_module("dcsched.runtime.ops")  # registers torch.ops.dcsched.* before any graph is built


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals(), before=_register_ops)


__all__ = [
    "__version__",
    "Bundle", "InputInfo", "ParamInfo", "load", "save",
    "BundleError", "DcschedError", "GraphError", "ResultMismatch",
    "to_fx", "to_networkx", "Role", "role_of",
    "capture", "capture_script", "tracing_checkpoints", "ProfileOptions", "profile_bundle",
    "Budget", "Plan", "schedule", "simulate", "SimResult", "replay_orders", "backend", "shard",
    "MixedPrecisionPolicy", "save_checkpoint", "load_checkpoint", "CheckpointError",
]
