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

from dcsched.lazy import lazy_names

#: Public name -> the module (in this package) that defines it.
_LAZY = {
    "Backend": "backend",
    "TrainOptions": "options", "ScriptOptions": "options",
    "CheckpointError": "checkpoint", "load_checkpoint": "checkpoint", "save_checkpoint": "checkpoint",
    "ShardSpec": "sharding", "Sharding": "sharding", "ShardingError": "sharding", "shard": "sharding",
    "sharding_of": "sharding", "MixedPrecisionPolicy": "mixed_precision",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())


__all__ = ["Backend", "TrainOptions", "ScriptOptions", "CheckpointError", "load_checkpoint", "save_checkpoint",
           "ShardSpec", "Sharding", "ShardingError", "shard", "sharding_of", "MixedPrecisionPolicy"]
