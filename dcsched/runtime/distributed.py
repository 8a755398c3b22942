"""ZeRO-3 for real across processes: sharded parameters behind the dcsched ops.

Under ``torchrun --nproc-per-node W`` every rank holds a 1-D shard of each
parameter. :class:`DistributedZero3Runtime` (installed with
:func:`dcsched.runtime.ops.set_runtime`) gives the four ops their distributed meaning:

- ``allgather_param``: ``all_gather_into_tensor`` of the shards on the default
  process group (gloo on CPU, NCCL on CUDA), started asynchronously into a
  fresh buffer, which the op returns viewed as the full parameter;
- ``wait_allgather``: waits on that collective's work handle;
- ``release_param``: frees the gathered buffer at its ``n_users``-th release
  (the single-process behaviour, inherited);
- ``reduce_grad``: reduce-scatters the gradient, averaging over the ranks as
  data-parallel training does, and returns this rank's 1-D shard.

On CUDA, NCCL runs each collective on its own stream: the ProcessGroup makes
that stream wait for the compute stream when the collective is issued, and
``work.wait()`` at the wait node makes the compute stream (not the host) wait
for it, so compute issued between the two overlaps the transfer. The runtime
keeps every buffer a collective reads or writes referenced until it has been
waited on, so the caching allocator cannot hand their memory to the compute
stream early. With ``async_reduce`` set (training on CUDA sets it) the
reduce-scatters are issued the same way and waited on together by
:meth:`DistributedZero3Runtime.finish` at the end of the backward graph, instead
of stalling the compute stream at each one; on the CPU (gloo) they stay
synchronous.

Parameters whose size does not divide by W are padded with zeros to the next
multiple of W, as DeepSpeed's ZeRO-3 pads them; rank r holds elements
``[r * n, (r + 1) * n)`` of the flattened, padded parameter (n = padded / W).

>>> padded_numel(21, 2), padded_numel(28, 2), padded_numel(5, 4)
(22, 28, 8)
>>> shard_of(torch.arange(5.0), rank=1, world_size=2)
tensor([3., 4., 0.])
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable

import torch
import torch.distributed as dist

from dcsched.bundle.core import ParamInfo
from dcsched.errors import DcschedError
from dcsched.runtime.ops import Zero3Runtime

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (same operations).
# The new names where they exist, so no run prints the old ones' deprecation warnings.
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


#: Collectives this process's ZeRO-3 runtimes have issued (all-gathers and reduce-scatters): the progress a
#: peer's failure watch reads (a rank whose count stops while another waits in a later one is stuck).
_ISSUED = [0]


def collectives_issued() -> int:
    """How many ZeRO-3 collectives this process has issued so far."""
    return _ISSUED[0]


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size`` (DeepSpeed's ZeRO-3 padding)."""
    return -(-numel // world_size) * world_size


def shard_of(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s 1-D shard of ``full``: its slice of the flattened tensor, zero-padded."""
    flat = full.reshape(-1)
    chunk = padded_numel(flat.numel(), world_size) // world_size
    shard = torch.zeros(chunk, dtype=full.dtype, device=full.device)
    start = rank * chunk
    stop = min(start + chunk, flat.numel())
    if stop > start:
        shard[: stop - start] = flat[start:stop]
    return shard


class DistributedZero3Runtime(Zero3Runtime):
    """The ZeRO-3 ops over a real process group; ``params`` gives each ds_id's full shape."""

    def __init__(self, params: Iterable[ParamInfo], group=None) -> None:
        super().__init__()
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.shapes: dict[int, tuple[int, ...]] = {p.ds_id: tuple(p.shape) for p in params}
        self.pending: dict[tuple[int, int], object] = {}
        self._average_op = True  # falls back to SUM then divide where the backend lacks AVG
        #: Issue reduce-scatters asynchronously; :meth:`finish` waits on them (the graph's end).
        self.async_reduce = False
        self.reducing: list[tuple] = []  # (work, output, input, divide): referenced until waited on

    def reset(self) -> None:
        super().reset()
        self.pending.clear()
        self.finish()

    def finish(self) -> None:
        """Wait on every asynchronous reduce-scatter (their outputs are ready on the current stream after)."""
        reducing, self.reducing = self.reducing, []
        for work, out, _source, divide in reducing:
            work.wait()
            if divide:
                out.div_(self.world_size)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        return shard_of(full, self.rank, self.world_size)

    def _shape(self, ds_id: int) -> tuple[int, ...]:
        try:
            return self.shapes[ds_id]
        except KeyError:
            raise DcschedError(f"graph gathers parameter ds_id {ds_id}, which the bundle's "
                               "parameter table does not list") from None

    # -- kernels -----------------------------------------------------------
    def allgather(self, shard, graph_id, ds_id, dtype):
        shape = self._shape(ds_id)
        numel = 1
        for size in shape:
            numel *= size
        source = shard.reshape(-1)
        if dtype is not None and dtype != source.dtype:
            source = source.to(dtype)
        buffer = torch.empty(source.numel() * self.world_size, dtype=source.dtype, device=source.device)
        source = source.contiguous()
        _ISSUED[0] += 1
        work = all_gather_into_tensor(buffer, source, group=self.group, async_op=True)
        self.pending[(graph_id, ds_id)] = (work, source)  # the input stays referenced until the wait
        full = buffer[:numel].view(shape)
        self.gathered[(graph_id, ds_id)] = full
        return full

    def wait(self, gathered, graph_id, ds_id):
        pending = self.pending.pop((graph_id, ds_id), None)
        if pending is not None:
            pending[0].wait()
        return gathered.view_as(gathered)

    def reduce(self, grad, graph_id, ds_id):
        flat = grad.reshape(-1)
        total = padded_numel(flat.numel(), self.world_size)
        if total != flat.numel():
            flat = torch.cat([flat, flat.new_zeros(total - flat.numel())])
        out = torch.empty(total // self.world_size, dtype=grad.dtype, device=grad.device)
        flat = flat.contiguous()
        if self._average_op:
            try:
                return self._reduce_scatter(out, flat, dist.ReduceOp.AVG, divide=False)
            except (ValueError, RuntimeError):
                self._average_op = False  # e.g. gloo builds without AVG
        return self._reduce_scatter(out, flat, dist.ReduceOp.SUM, divide=True)

    def _reduce_scatter(self, out, flat, op, divide: bool):
        _ISSUED[0] += 1
        if self.async_reduce:
            work = reduce_scatter_tensor(out, flat, op=op, group=self.group, async_op=True)
            self.reducing.append((work, out, flat, divide))
            return out
        reduce_scatter_tensor(out, flat, op=op, group=self.group)
        return out.div_(self.world_size) if divide else out

    def reduced_shard_like(self, grad, graph_id, ds_id):
        total = padded_numel(grad.numel(), self.world_size)
        return grad.new_empty(total // self.world_size)

    def gathered_like(self, shard, graph_id, ds_id, dtype):
        return shard.new_empty(self._shape(ds_id), dtype=dtype if dtype is not None else shard.dtype)


# ---------------------------------------------------------------------------
# Process group set-up under torchrun
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Launch:
    """Where this process stands in a torchrun launch."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def launched() -> bool:
    """Whether this process was started by torchrun (or alike) as one of several ranks."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    except ValueError:
        return False


def init(device_type: str, *, store=None, rank: int = -1, world_size: int = -1, timeout=None) -> Launch:
    """Join the default process group from torchrun's environment: gloo on CPU, NCCL on CUDA.

    ``store``, ``rank`` and ``world_size`` (a rendezvous already made) and
    ``timeout`` (a ``datetime.timedelta``) go to ``init_process_group``.

    Raises :class:`DcschedError` when torch.distributed or the backend is missing.
    """
    if not dist.is_available():
        raise DcschedError("this torch build has no torch.distributed; run replay without torchrun")
    backend = "nccl" if device_type == "cuda" else "gloo"
    available = dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()
    if not available:
        raise DcschedError(f"this torch build has no {backend} backend for a {device_type} replay")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        given = {"store": store, "rank": rank, "world_size": world_size} if store is not None else {}
        if timeout is not None:
            given["timeout"] = timeout
        if backend == "nccl":
            given["device_id"] = device
        dist.init_process_group(backend, **given)
    return Launch(dist.get_rank(), dist.get_world_size(), local_rank, device)


def shutdown(*, together: bool = True) -> None:
    """Leave the process group.

    ``together`` (the normal end) waits at a barrier first: a rank that tears
    its connections down while a peer still talks to it makes gloo abort the
    peer (SIGABRT) instead of letting it finish. After a failure pass
    ``together=False``: the other ranks may never reach the barrier.
    """
    if dist.is_available() and dist.is_initialized():
        try:
            if together:
                dist.barrier()
        finally:
            dist.destroy_process_group()
