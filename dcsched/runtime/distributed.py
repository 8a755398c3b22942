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
  data-parallel training does, and returns this rank's 1-D shard
  (all-reduces it for a replicated parameter, below).

On CUDA, NCCL runs each collective on its own stream: the ProcessGroup makes
that stream wait for the compute stream when the collective is issued, and
``work.wait()`` at the wait node makes the compute stream (not the host) wait
for it, so compute issued between the two overlaps the transfer. The runtime
keeps every buffer a collective reads or writes referenced until it has been
waited on, so the caching allocator cannot hand their memory to the compute
stream early. Reduce-scatters are issued asynchronously on every backend (gloo
too) and waited on by :meth:`DistributedZero3Runtime.finish` at the end of the
backward graph, except that issuing one while ``reduces_in_flight`` (default
1) are pending waits on the oldest first, so that each gradient is freed near
its reduce rather than at the backward's end (an :attr:`~DistributedZero3Runtime.issue`
without ``async_reduce``: each waited on where it is issued).

**The communication plan** (:meth:`~dcsched.runtime.ops.Zero3Runtime.set_plan`,
a :class:`~dcsched.runtime.commplan.CommPlan`; the layout is
:mod:`dcsched.runtime.buckets`):

- an all-gather bucket is one ``all_gather_into_tensor`` of its members'
  shards, concatenated, issued when the first member's gather runs (the other
  members' shards come from the graph's inputs, bound at the graph's start);
  the first wait of any member waits on it and copies every member's full
  parameter out of the flat output into a buffer of its own (so each is freed
  at its own last release), then drops the flat tensors; later members'
  gathers return their buffer and issue nothing;
- a reduce bucket is one ``reduce_scatter_tensor``: each member's reduce copies
  its gradient into its slot of the bucket's flat input and returns its shard,
  a view of the bucket's output (filled once waited on); the last member to
  arrive issues it;
- a kept parameter is not freed at its last release in the forward; the
  backward's gather returns the held buffer with no collective
  (:class:`~dcsched.runtime.ops.Zero3Runtime`);
- a replicated parameter is whole on every rank: its "shard" is the
  flattened parameter, its gather issues nothing and returns it viewed in
  the full shape, its release frees nothing, and its reduce is an
  ``all_reduce`` of the gradient, averaged as the reduce-scatters are
  (asynchronous alike, under the same in-flight rule), returning the whole
  flattened gradient. A reduce bucket of replicated parameters is one
  all-reduce, in place, of their gradients laid end to end
  (:func:`~dcsched.runtime.commplan.comm_plan` splits mixed buckets).

:attr:`~dcsched.runtime.ops.Zero3Runtime.issued` counts each graph's
collectives of its latest run: all-gathers + reduces, less ``len - 1`` per
bucket, less the backward's gathers of kept parameters, less every gather
of a replicated one (``tests/comm_counts.py`` counts them);
:attr:`DistributedZero3Runtime.all_reduces` counts the all-reduces. Every real collective
also counts once in the process-wide count :func:`collectives_issued`.

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
import math
import os
from typing import Iterable

import torch
import torch.distributed as dist

from dcsched.bundle.core import ParamInfo
from dcsched.collective_issue import PROCESS_GROUP, CollectiveIssue
from dcsched.errors import DcschedError
from dcsched.runtime.buckets import offsets, pack_gradient, unpack_gathered
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


def note_issued() -> None:
    """Count one collective more that every rank issues at the same point of the step (a step's agreement)."""
    _ISSUED[0] += 1


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


class _GatherBucket:
    """One bucket's all-gather in flight: the work, its flat output and input (this rank's row of the output:
    the bucket gathers in place), and where each member goes."""

    def __init__(self, work, source: torch.Tensor, output: torch.Tensor,
                 members: list[tuple[int, torch.Tensor, int, int]]) -> None:
        self.work, self.source, self.output = work, source, output
        self.members = members  # (ds_id, padded buffer, offset, shard size)

    def complete(self, world_size: int) -> None:
        """Wait, copy each member's full parameter into its own buffer, then let the flat output go."""
        if self.work is None:  # completed already
            return
        self.work.wait()
        for _ds_id, padded, offset, size in self.members:
            padded.untyped_storage().resize_(padded.numel() * padded.element_size())
            unpack_gathered(self.output, world_size, offset, size, padded.view(world_size, size))
        # freed here (the input with it: a row of it), not whenever the process group's own reference to it
        # goes (a gloo thread's, late under load): where the simulator frees it, and what a memory tracker sees
        self.output.untyped_storage().resize_(0)
        self.work = self.source = self.output = None
        self.members = []


class _ReduceBucket:
    """One reduce bucket being filled: its flat input and output, and who has arrived.

    Sharded members (``whole`` false): one reduce-scatter, each member's
    padded gradient a ``(W, size)`` column block of the input
    (:mod:`dcsched.runtime.buckets`), its shard a slice of the output.
    Replicated members (``whole``): one all-reduce, in place, of the members'
    flattened gradients laid end to end; each member's result is its slice.
    """

    def __init__(self, ds_ids: tuple[int, ...], sizes: list[int], grad: torch.Tensor, world_size: int,
                 whole: bool = False, dtype: torch.dtype | None = None) -> None:
        self.ds_ids, self.whole = ds_ids, whole
        self.place = dict(zip(ds_ids, zip(offsets(sizes), sizes)))
        total = sum(sizes)
        # in the reduce dtype (mixed precision): each member's gradient is cast as it is copied in
        self.source = grad.new_empty(total if whole else world_size * total, dtype=dtype or grad.dtype)
        self.output = self.source if whole else self.source.new_empty(total)
        self.arrived: set[int] = set()

    def slot(self, ds_id: int, world_size: int) -> torch.Tensor:
        offset, size = self.place[ds_id]
        if self.whole:
            return self.source[offset:offset + size]
        return self.source.view(world_size, -1)[:, offset:offset + size]

    def put(self, ds_id: int, grad: torch.Tensor, world_size: int) -> None:
        """Copy member ``ds_id``'s gradient into its slot."""
        if self.whole:
            self.slot(ds_id, world_size).copy_(grad.reshape(-1))
        else:
            pack_gradient(grad, self.slot(ds_id, world_size))
        self.arrived.add(ds_id)

    def shard(self, ds_id: int) -> torch.Tensor:
        offset, size = self.place[ds_id]
        return self.output[offset:offset + size]


class DistributedZero3Runtime(Zero3Runtime):
    """The ZeRO-3 ops over a real process group; ``params`` gives each ds_id's full shape.

    With a communication plan (:meth:`set_plan`), an all-gather bucket is one
    ``all_gather_into_tensor`` issued at the first member's gather, from the
    shards :meth:`begin_graph` bound; a bucket one of whose members' shards is
    not a graph input (a computed value) runs member by member. A reduce
    bucket is one ``reduce_scatter_tensor`` issued when its last member's
    gradient arrives (or at the graph's end for members that never came).
    """

    #: How the collectives are issued (its ``async_gather`` and ``async_reduce``; gloo stages whatever
    #: ``staging`` says): all-gathers asynchronous, waited on at their wait node (else each waited on where it
    #: is issued, as FSDP2 issues them on gloo, so gloo's staging copy is gone before the compute goes on);
    #: reduce-scatters asynchronous, :meth:`finish` waiting on them at the backward's end (else each waited on
    #: where it is issued).
    issue: CollectiveIssue = PROCESS_GROUP
    #: Per graph_id, how that graph's collectives are issued, where it differs from :attr:`issue` (training
    #: sets it per graph: what each graph's budget holds, ``dcsched.train.backend``).
    issues: dict[int, CollectiveIssue]
    #: At most this many asynchronous reduce-scatters in flight (None: no limit): issuing one more waits on
    #: the oldest, so its input (the gradient) is freed near its reduce rather than every gradient living to
    #: the backward's end. One, as FSDP2 keeps the previous one in flight.
    reduces_in_flight: int | None = 1
    #: a bucket's flat tensors at its latest copy-out (:meth:`transient_bytes`)
    _transient: int = 0

    def transient_bytes(self) -> int:
        """:meth:`Zero3Runtime.transient_bytes`: a bucket's flat tensors at its copy-out."""
        transient = self._transient
        self._transient = 0
        return transient

    def buffers(self) -> list[torch.Tensor]:
        """The flat tensors of the buckets being filled or in flight, and bucket members' buffers not yet asked
        for (:meth:`Zero3Runtime.buffers`)."""
        held: list = [t for bucket in self._reduce_buckets.values() for t in (bucket.source, bucket.output)]
        held += [t for entry in self.reducing for t in entry[1:3]]
        held += [t for pending in self.pending.values() if isinstance(pending, _GatherBucket)
                 for t in (pending.source, pending.output)]
        held += list(self._ready.values())
        return [t for t in held if isinstance(t, torch.Tensor)]

    def __init__(self, params: Iterable[ParamInfo], group=None) -> None:
        super().__init__()
        self.group = group
        # The group the shards are exchanged over: this runtime runs the plan, it prices nothing (a profile's
        # world size is its topology's, dcsched.costmodels.topology).
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.shapes: dict[int, tuple[int, ...]] = {p.ds_id: tuple(p.shape) for p in params}
        #: Gathers in flight by (graph_id, ds_id): (work, input) alone, or a bucket's :class:`_GatherBucket`.
        self.pending: dict[tuple[int, int], object] = {}
        self._average_op = True  # falls back to SUM then divide where the backend lacks AVG
        self.reducing: list[tuple] = []  # (work, output, input, divide, owned): referenced until waited on
        self._ready: dict[tuple[int, int], torch.Tensor] = {}  # bucket members' buffers, not yet asked for
        self._gathered_buckets: set[tuple[int, tuple[int, ...]]] = set()  # issued (or run alone) this run
        self._reduce_buckets: dict[tuple[int, tuple[int, ...]], _ReduceBucket] = {}
        #: All-reduces (replicated parameters' gradients) this runtime has issued, over every run.
        self.all_reduces = 0
        self.issues = {}

    def issue_in(self, graph_id: int) -> CollectiveIssue:
        """How graph ``graph_id``'s collectives are issued (:attr:`issues`, else :attr:`issue`)."""
        return self.issues.get(graph_id, self.issue)

    def reset(self) -> None:
        super().reset()
        self.finish()
        # What a graph that stopped half-way (an error) left: nothing more is sent or waited on, since the
        # other ranks may never send their part.
        self.pending.clear()
        self._ready.clear()
        self._gathered_buckets.clear()
        self._reduce_buckets.clear()

    def begin_graph(self, graph_id, inputs) -> None:
        super().begin_graph(graph_id, inputs)
        self._gathered_buckets.clear()

    def end_graph(self, graph_id) -> None:
        # Reduce buckets some member never reached: sent with zeros in its place, so no rank waits forever.
        for (bucket_graph, _ids), bucket in list(self._reduce_buckets.items()):
            for ds_id in bucket.ds_ids:
                if ds_id not in bucket.arrived:
                    bucket.slot(ds_id, self.world_size).zero_()
            self._issue_reduce_bucket(bucket_graph, bucket)
        self._reduce_buckets.clear()
        self._settle()
        super().end_graph(graph_id)

    def _settle(self) -> None:
        """Wait on gathers no wait node claimed, so no buffer is freed while a collective writes it."""
        for pending in {id(p): p for p in self.pending.values()}.values():
            if isinstance(pending, _GatherBucket):
                pending.complete(self.world_size)
            else:
                pending[0].wait()  # type: ignore[index]
        self.pending.clear()
        self._ready.clear()

    def finish(self) -> None:
        """Wait on every asynchronous reduce-scatter (their outputs are ready on the current stream after)."""
        reducing, self.reducing = self.reducing, []
        for pending in reducing:
            self._wait_reduce(*pending)

    def _wait_reduce(self, work, out, source, divide: bool, owned: bool) -> None:
        work.wait()
        if divide:
            out.div_(self.world_size)
        if owned:  # the runtime's own input buffer: freed now, as _GatherBucket.complete frees its flat tensors
            source.untyped_storage().resize_(0)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        return shard_of(full, self.rank, self.world_size)

    def _shape(self, ds_id: int) -> tuple[int, ...]:
        try:
            return self.shapes[ds_id]
        except KeyError:
            raise DcschedError(f"graph gathers parameter ds_id {ds_id}, which the bundle's "
                               "parameter table does not list") from None

    def _numel(self, ds_id: int) -> int:
        return math.prod(self._shape(ds_id))

    def _issued(self, graph_id: int) -> None:
        _ISSUED[0] += 1
        self.count_issued(graph_id)

    # -- replicated parameters ----------------------------------------------
    def allgather(self, shard, graph_id, ds_id, dtype):
        if not self.plan.is_replicated(ds_id):
            return super().allgather(shard, graph_id, ds_id, dtype)
        # Whole on every rank: the "shard" is the flattened parameter; nothing is sent, no buffer is made.
        full = shard.reshape(-1)[:self._numel(ds_id)].view(self._shape(ds_id))
        full = full.to(dtype) if dtype is not None and dtype != full.dtype else full
        self.gathered[(graph_id, ds_id)] = full
        return full

    def release(self, value, graph_id, ds_id, n_users):
        if not self.plan.is_replicated(ds_id):
            return super().release(value, graph_id, ds_id, n_users)
        # The parameter itself (or a cast of it, left to Python to free): nothing to free or to hold.
        key = (graph_id, ds_id)
        count = self.release_counts.get(key, 0) + 1
        if count >= n_users:
            self.release_counts.pop(key, None)
            self.gathered.pop(key, None)
        else:
            self.release_counts[key] = count
        return value.view_as(value)

    # -- gathers -----------------------------------------------------------
    def _gather(self, shard, graph_id, ds_id, dtype):
        ready = self._ready.pop((graph_id, ds_id), None)
        if ready is not None:  # an earlier member issued this one's bucket
            return ready
        members = self._bucket_to_gather(shard, graph_id, ds_id, dtype)
        if members is not None:
            return self._gather_bucket(graph_id, ds_id, members)
        return self._gather_one(shard, graph_id, ds_id, dtype)

    def _bucket_to_gather(self, shard, graph_id, ds_id, dtype) -> list[tuple[int, torch.Tensor]] | None:
        """The members of ``ds_id``'s bucket with their sources (cast), or None: gather alone.

        Alone when there is no bucket, it ran already this graph run, or a
        member's shard is not a bound graph input, or the members do not share
        one dtype and device (one flat tensor holds them).
        """
        bucket = self.plan.allgather_bucket_of(graph_id, ds_id)
        if bucket is None or (graph_id, bucket) in self._gathered_buckets:
            return None
        self._gathered_buckets.add((graph_id, bucket))  # decided once: issued now, or every member alone
        members = []
        for member in bucket:
            if member == ds_id:
                source, cast = shard, dtype
            elif member in self.bound and (graph_id, member) not in self.gathered:
                source, cast = self.bound[member]
            else:
                return None
            source = source.reshape(-1)
            members.append((member, source.to(cast) if cast is not None else source))
        if len({(s.dtype, s.device) for _m, s in members}) > 1:
            return None
        return members

    def _gather_bucket(self, graph_id: int, ds_id: int, members: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        sizes = [source.numel() for _m, source in members]
        total = sum(sizes)
        output = members[0][1].new_empty(total * self.world_size)
        # In place, as FSDP2 gathers: this rank's input is its own row of the output, so the bucket holds no
        # flat input of its own (the shards are copied once, into the row, as a separate input would need).
        source = output[self.rank * total:(self.rank + 1) * total]
        torch.cat([s for _m, s in members], out=source)
        self._issued(graph_id)
        work = self._all_gather(output, source, graph_id)
        placed, fulls = [], {}
        for (member, _s), offset, size in zip(members, offsets(sizes), sizes):
            padded = source.new_empty(size * self.world_size)
            fulls[member] = padded[:self._numel(member)].view(self._shape(member))
            # no bytes until the copy-out (as FSDP2's unsharded parameters): the flat output holds them till then
            padded.untyped_storage().resize_(0)
            placed.append((member, padded, offset, size))
        pending = _GatherBucket(work, source, output, placed)
        for member, full in fulls.items():
            self.pending[(graph_id, member)] = pending
            if member != ds_id:
                self._ready[(graph_id, member)] = full
        return fulls[ds_id]

    def _gather_one(self, shard, graph_id, ds_id, dtype):
        shape = self._shape(ds_id)
        source = shard.reshape(-1)
        if dtype is not None and dtype != source.dtype:
            source = source.to(dtype)
        buffer = torch.empty(source.numel() * self.world_size, dtype=source.dtype, device=source.device)
        source = source.contiguous()
        self._issued(graph_id)
        work = self._all_gather(buffer, source, graph_id)
        self.pending[(graph_id, ds_id)] = (work, source)  # the input stays referenced until the wait
        return buffer[:self._numel(ds_id)].view(shape)

    def _all_gather(self, output: torch.Tensor, source: torch.Tensor, graph_id: int):
        """Issue one all-gather into ``output``, done before it returns unless the graph's gathers are
        asynchronous (:meth:`issue_in`)."""
        work = all_gather_into_tensor(output, source, group=self.group, async_op=True)
        if not self.issue_in(graph_id).async_gather:
            work.wait()  # the wait node's own wait then returns at once
        return work

    def wait(self, gathered, graph_id, ds_id):
        pending = self.pending.pop((graph_id, ds_id), None)
        if isinstance(pending, _GatherBucket):  # the bucket's first wait fills every member's buffer
            for member, *_rest in pending.members:
                self.pending.pop((graph_id, member), None)
            # the flat tensors live beside the members' new buffers until the copy-out ends
            self._transient = pending.output.untyped_storage().nbytes()  # the input is a row of it
            pending.complete(self.world_size)
        elif pending is not None:
            pending[0].wait()
        return gathered.view_as(gathered)

    # -- reduces -----------------------------------------------------------
    def reduce(self, grad, graph_id, ds_id):
        # mixed precision: the collective moves the reduce dtype's bytes; the gradient is cast where it is copied
        # into the collective's input (a bucket's, a padded one), as FSDP2 casts it into its reduce-scatter input
        dtype = self.reduce_dtypes.get(ds_id, grad.dtype)
        whole = self.plan.is_replicated(ds_id)
        bucket_ids = self.plan.reduce_bucket_of(graph_id, ds_id)
        if bucket_ids is None:
            return self._all_reduce_one(grad, graph_id, dtype) if whole else self._reduce_one(grad, graph_id, dtype)
        key = (graph_id, bucket_ids)
        bucket = self._reduce_buckets.get(key)
        if bucket is None:
            # comm_plan splits mixed buckets: every member is replicated or none is
            sizes = [self._numel(m) if whole else padded_numel(self._numel(m), self.world_size) // self.world_size
                     for m in bucket_ids]
            bucket = self._reduce_buckets[key] = _ReduceBucket(bucket_ids, sizes, grad, self.world_size, whole,
                                                               dtype)
        if ds_id in bucket.arrived or (dtype, grad.device) != (bucket.source.dtype, bucket.source.device):
            # Reduced twice in one graph, or in another dtype than the bucket's first member: alone.
            return self._all_reduce_one(grad, graph_id, dtype) if whole else self._reduce_one(grad, graph_id, dtype)
        bucket.put(ds_id, grad, self.world_size)
        shard = bucket.shard(ds_id)
        if len(bucket.arrived) == len(bucket.ds_ids):
            del self._reduce_buckets[key]
            self._issue_reduce_bucket(graph_id, bucket)
        return shard

    def _issue_reduce_bucket(self, graph_id: int, bucket: _ReduceBucket) -> None:
        # a reduce-scatter's flat input is the runtime's own; an all-reduce's is its output, the members' results
        self._mean(bucket.output, bucket.source, graph_id, owned=not bucket.whole)

    def _reduce_one(self, grad, graph_id, dtype=None):
        flat = grad.reshape(-1)
        dtype = dtype or grad.dtype
        total = padded_numel(flat.numel(), self.world_size)
        if total != flat.numel() or dtype != flat.dtype:  # one copy, padded and cast
            padded = flat.new_zeros(total, dtype=dtype)
            padded[:flat.numel()].copy_(flat)
            flat = padded
        out = torch.empty(total // self.world_size, dtype=dtype, device=grad.device)
        flat = flat.contiguous()
        # a padded or contiguous copy is the runtime's own; a view of the gradient is the graph's
        owned = flat.untyped_storage().data_ptr() != grad.untyped_storage().data_ptr()
        return self._mean(out, flat, graph_id, owned=owned)

    def _all_reduce_one(self, grad, graph_id, dtype=None):
        # A fresh buffer (the gradient may be read again, and the simulator frees it at its reduce, as a
        # reduce-scatter's input), in the reduce dtype, all-reduced in place.
        flat = grad.reshape(-1).to(dtype or grad.dtype, copy=True)
        return self._mean(flat, flat, graph_id)

    def _mean(self, out, flat, graph_id: int, owned: bool = False):
        """Reduce ``flat`` into ``out`` averaging over the ranks; ``out`` is ready after :meth:`finish`.

        A reduce-scatter, or an all-reduce in place where ``out`` is ``flat`` (replicated parameters). Both
        average alike (AVG, or SUM then a division by W where the backend lacks AVG), so a replicated
        parameter's gradient is, element for element, what the sharded path gives. ``owned``: ``flat`` is the
        runtime's own buffer, freed once the collective is done.
        """
        if self._average_op:
            try:
                return self._reduce(out, flat, dist.ReduceOp.AVG, graph_id, divide=False, owned=owned)
            except (ValueError, RuntimeError):
                self._average_op = False  # e.g. gloo builds without AVG
                _ISSUED[0] -= 1  # not issued after all
                self.issued[graph_id] -= 1
        return self._reduce(out, flat, dist.ReduceOp.SUM, graph_id, divide=True, owned=owned)

    def _reduce(self, out, flat, op, graph_id: int, divide: bool, owned: bool):
        self._issued(graph_id)
        issue = dist.all_reduce if out is flat else reduce_scatter_tensor
        args = (flat,) if out is flat else (out, flat)
        if self.issue_in(graph_id).async_reduce:
            work = issue(*args, op=op, group=self.group, async_op=True)
            self.all_reduces += out is flat
            self.reducing.append((work, out, flat, divide, owned))
            while self.reduces_in_flight is not None and len(self.reducing) > self.reduces_in_flight:
                self._wait_reduce(*self.reducing.pop(0))
            return out
        issue(*args, op=op, group=self.group)
        self.all_reduces += out is flat
        if owned:
            flat.untyped_storage().resize_(0)
        return out.div_(self.world_size) if divide else out

    def reduced_shard_like(self, grad, graph_id, ds_id):
        dtype = self.reduce_dtypes.get(ds_id, grad.dtype)
        if self.plan.is_replicated(ds_id):
            return grad.new_empty(grad.numel(), dtype=dtype)
        total = padded_numel(grad.numel(), self.world_size)
        return grad.new_empty(total // self.world_size, dtype=dtype)


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
    return Launch(dist.get_rank(), dist.get_world_size(), local_rank, device)  # the launch's, for its caller


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
