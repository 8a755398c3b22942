"""Training with a dcsched schedule: ZeRO-3 sharding, a TorchDynamo backend, checkpoints (see docs/train.md).

``dcsched.shard(model)`` shards a module's parameters in place;
``torch.compile(model, backend=dcsched.backend(algo=...))`` runs its steps
through the scheduled forward and backward graphs;
``dcsched.save_checkpoint`` / ``dcsched.load_checkpoint`` write and read DCP checkpoints of both.
"""

from __future__ import annotations

from dcsched.train.backend import Backend, TrainOptions, backend
from dcsched.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from dcsched.train.sharding import ShardSpec, Sharding, ShardingError, shard, sharding_of

__all__ = ["Backend", "TrainOptions", "backend", "CheckpointError", "load_checkpoint", "save_checkpoint",
           "ShardSpec", "Sharding", "ShardingError", "shard", "sharding_of"]
