"""Training with a dcsched schedule: ZeRO-3 sharding, a TorchDynamo backend, checkpoints (see docs/train.md).

``dcsched.shard(model)`` shards a module's parameters in place;
``torch.compile(model, backend=dcsched.backend(algo=...))`` runs its steps
through the scheduled forward and backward graphs;
``dcsched.save_checkpoint`` / ``dcsched.load_checkpoint`` write and read DCP checkpoints of both.

The names below are imported on first use, so that :mod:`dcsched.train.options`
(which the command line reads its defaults from) can be imported without
torch. ``dcsched.train.backend`` is the module; the backend function is
``dcsched.backend``.
"""

from __future__ import annotations

#: Public name -> the module (in this package) that defines it.
_LAZY = {
    "Backend": "backend",
    "TrainOptions": "options", "ScriptOptions": "options",
    "CheckpointError": "checkpoint", "load_checkpoint": "checkpoint", "save_checkpoint": "checkpoint",
    "ShardSpec": "sharding", "Sharding": "sharding", "ShardingError": "sharding", "shard": "sharding",
    "sharding_of": "sharding",
}


def __getattr__(name: str):
    import importlib
    import importlib.util
    if name not in _LAZY:
        # A submodule (dcsched.train.backend, ...) is an attribute once imported.
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["Backend", "TrainOptions", "ScriptOptions", "CheckpointError", "load_checkpoint", "save_checkpoint",
           "ShardSpec", "Sharding", "ShardingError", "shard", "sharding_of"]
