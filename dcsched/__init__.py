"""dcsched: schedule ZeRO-3 / DeepCompile training graphs outside a live DeepSpeed job.

The flow is profile -> bundle -> schedule -> report -> replay; every stage is a
pure function usable from Python, and the ``dcsched`` command line only parses,
calls and renders. ``dcsched.capture``, ``dcsched.simulate`` and
``dcsched.schedule`` are functions; their modules are reached with
``from dcsched.simulate import compile_view`` and the like.
"""

from __future__ import annotations

import sys
import types

__version__ = "0.1.0"

#: Public name -> the module that defines it. Imported on first use (module ``__getattr__``), so that
#: ``import dcsched`` and ``dcsched --help`` do not pay for importing torch.
_LAZY = {
    "Bundle": "bundle", "InputInfo": "bundle", "ParamInfo": "bundle", "load": "bundle", "save": "bundle",
    "BundleError": "errors", "DcschedError": "errors", "GraphError": "errors", "ResultMismatch": "errors",
    "to_fx": "nxview", "to_networkx": "nxview", "Role": "roles", "role_of": "roles",
    "capture": "capture", "capture_script": "capture", "ProfileOptions": "profile", "profile_bundle": "profile",
    "schedule": "reorder", "simulate": "simulate", "SimResult": "simulate", "replay_orders": "replay",
    "backend": "train", "shard": "train",
    "save_checkpoint": "train", "load_checkpoint": "train", "CheckpointError": "train",
}


def __getattr__(name: str):
    """``dcsched.load`` and the other public names, imported when first asked for.

    >>> import dcsched
    >>> dcsched.load.__module__
    'dcsched.bundle'
    """
    import importlib
    import importlib.util
    if name not in _LAZY:
        # A submodule (dcsched.reorder, ...) is an attribute once imported, as it was when the package imported all.
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'dcsched' has no attribute {name!r}")
        return importlib.import_module(f".{name}", __name__)
    importlib.import_module(".ops", __name__)  # registers torch.ops.dcsched.* before any graph is built
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # the function shadows its module (capture, simulate) from here on, as before
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


#: Functions that share their module's name: importing the module must not replace the function.
_SHADOWING = ("capture", "simulate")


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        if name in _SHADOWING and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "__version__",
    "Bundle", "InputInfo", "ParamInfo", "load", "save",
    "BundleError", "DcschedError", "GraphError", "ResultMismatch",
    "to_fx", "to_networkx", "Role", "role_of",
    "capture", "capture_script", "ProfileOptions", "profile_bundle",
    "schedule", "simulate", "SimResult", "replay_orders", "backend", "shard",
    "save_checkpoint", "load_checkpoint", "CheckpointError",
]
