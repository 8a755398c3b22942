"""Training with a dcsched schedule: ZeRO-3 sharding, a TorchDynamo backend, checkpoints (see docs/train.md).

``dcsched.shard(model)`` shards a module's parameters in place;
``torch.compile(model, backend=dcsched.backend(algo=...))`` runs its steps
through the scheduled forward and backward graphs.
"""

from __future__ import annotations

from .backend import Backend, TrainOptions, backend
from .sharding import ShardSpec, Sharding, ShardingError, shard, sharding_of

__all__ = ["Backend", "TrainOptions", "backend", "ShardSpec", "Sharding", "ShardingError", "shard", "sharding_of"]
