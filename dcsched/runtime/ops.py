"""ZeRO-3 communication ops with DeepSpeed DeepCompile's schemas.

dcsched inserts four ops into captured graphs, exactly where DeepCompile inserts
its ``torch.ops.dc.*`` ops, so graphs from either origin look alike and every
part of dcsched treats them the same way:

    allgather_param(Tensor a, int graph_id, int id, ScalarType? dtype=None) -> Tensor
    wait_allgather(Tensor(a) a, int graph_id, int id) -> Tensor(a)
    release_param(Tensor(a) a, int graph_id, int id, int n_users) -> Tensor(a)
    reduce_grad(Tensor a, int graph_id, int id) -> Tensor

``graph_id`` identifies the graph and ``id`` is the parameter's ds_id. The ops
are the rows of :mod:`dcsched.collectives`, registered with torch by
:mod:`dcsched.graph.commops`; each one's kernel calls the :class:`Zero3Runtime`
method its row names (``allgather``, ``wait``, ``release``, ``reduce``; their
fake-tensor forms ``gathered_like``, ``alias_like``, ``reduced_shard_like``).

The kernels delegate to :data:`RUNTIME`, a :class:`Zero3Runtime`. In one
process (world size 1) the shard is the whole parameter, yet the all-gather
still allocates a fresh buffer that is freed at the parameter's last release,
so memory behaves as in a sharded run. ``reduce_grad`` returns this rank's
shard of the gradient (the whole gradient at world size 1).

The runtime runs the bundle's communication plan (``bundle.plans``): buckets
of collectives issued as one (across processes:
:mod:`dcsched.runtime.distributed`) and kept parameters, whose gathered buffer
the forward leaves to the backward instead of freeing it (every runtime, see
:class:`Zero3Runtime`).

The ops carry alias annotations, which AOT autograd cannot trace: they are
inserted after partitioning and graphs holding them are executed as FX graphs,
never re-traced.
"""

from __future__ import annotations

import torch

from dcsched.graph import commops

NAMESPACE = commops.NAMESPACE
#: DeepSpeed's namespace; graphs built by DeepSpeed use it.
DEEPSPEED_NAMESPACE = commops.DEEPSPEED_NAMESPACE
ensure_deepspeed_ops = commops.ensure_deepspeed_ops


class Zero3Runtime:
    """Process-wide state behind the ops: gathered buffers, release counts, kept parameters.

    The single-process behaviour lives here; :mod:`dcsched.replay` installs a
    distributed runtime (a subclass) for runs under ``torchrun``.

    **The communication plan** (:attr:`plan`, a
    :class:`~dcsched.runtime.commplan.CommPlan`; :meth:`set_plan`). Buckets
    are the distributed runtime's business (one process has nothing to
    communicate); kept residency is honoured here, for every runtime: a kept
    parameter's last release in the forward does not free its gathered buffer
    but holds it (:attr:`held`); the next graph's gather of it returns that
    buffer, with no collective, and its last release there frees it. Held
    buffers still unclaimed are freed when a graph other than the forward ends
    and when the next forward starts (an evaluation forward has no backward).

    **Graph runs.** The step runner (:mod:`dcsched.runtime.step`) calls
    :meth:`begin_graph` with the graph's parameter inputs before running it and
    :meth:`end_graph` after; the ops also work without them (every gather
    then runs alone). :attr:`issued` counts the collectives of each graph's
    latest run (always 0 here).

    >>> import torch
    >>> from dcsched.runtime.commplan import CommPlan
    >>> rt = Zero3Runtime()
    >>> rt.set_plan(CommPlan(kept=frozenset({5}), forward_graph_id=0))
    >>> rt.begin_graph(0, {})
    >>> full = rt.allgather(torch.ones(3), 0, 5, None)
    >>> _ = rt.release(full, 0, 5, 1)
    >>> rt.end_graph(0); sorted(rt.held), full.untyped_storage().nbytes()
    ([5], 12)
    >>> rt.begin_graph(1, {})
    >>> rt.allgather(torch.ones(3), 1, 5, None) is full
    True
    >>> _ = rt.release(full, 1, 5, 1); rt.end_graph(1); full.untyped_storage().nbytes()
    0
    """

    world_size = 1
    rank = 0

    def __init__(self) -> None:
        from dcsched.runtime.commplan import EMPTY
        self.gathered: dict[tuple[int, int], torch.Tensor] = {}
        self.release_counts: dict[tuple[int, int], int] = {}
        self.plan = EMPTY
        #: Kept parameters' gathered buffers between the forward and the graph that reuses them, by ds_id.
        self.held: dict[int, torch.Tensor] = {}
        #: Collectives issued by the latest run of each graph, by graph_id.
        self.issued: dict[int, int] = {}
        #: The running graph's parameter inputs: ds_id -> (shard, dtype of its gather) (:meth:`begin_graph`).
        self.bound: dict[int, tuple[torch.Tensor, torch.dtype | None]] = {}
        #: ds_id -> the dtype its gradient is reduced in (mixed precision), where not the gradient's own.
        self.reduce_dtypes: dict[int, torch.dtype] = {}

    def in_reduce_dtype(self, grad: torch.Tensor, ds_id: int) -> torch.Tensor:
        """``grad`` in the dtype ``ds_id``'s gradient is reduced in (:attr:`reduce_dtypes`)."""
        dtype = self.reduce_dtypes.get(ds_id)
        return grad if dtype is None or dtype == grad.dtype else grad.to(dtype)

    def set_plan(self, plan) -> None:
        """Run ``plan`` (a :class:`~dcsched.runtime.commplan.CommPlan`) from the next graph on."""
        self.plan = plan

    def reset(self) -> None:
        """Forget one graph run's state. Held (kept) parameters stay: the backward of this step reuses them."""
        self.gathered.clear()
        self.release_counts.clear()
        self.bound = {}

    def begin_graph(self, graph_id: int | None, inputs) -> None:
        """A graph run starts; ``inputs`` maps ds_id -> (shard, gather dtype) of the parameters it gathers."""
        if graph_id is None:
            return
        self.issued[graph_id] = 0
        if graph_id == self.plan.forward_graph_id:
            self.drop_held()  # a forward without backward (evaluation) left them
        # Only bucketed gathers read other parameters' shards; otherwise hold no reference to the inputs.
        self.bound = dict(inputs) if self.plan.allgather_buckets(graph_id) else {}

    def end_graph(self, graph_id: int | None) -> None:
        """A graph run ended: drop its inputs; after any graph but the forward, free unclaimed held buffers."""
        self.bound = {}
        if graph_id is not None and graph_id != self.plan.forward_graph_id:
            self.drop_held()

    def finish(self) -> None:
        """Wait on collectives still in flight (none in one process)."""

    def drop_held(self) -> None:
        """Free every held (kept) parameter buffer."""
        held, self.held = self.held, {}
        for buffer in held.values():
            buffer.untyped_storage().resize_(0)

    def count_issued(self, graph_id: int) -> None:
        """One collective issued for graph ``graph_id``'s current run."""
        self.issued[graph_id] = self.issued.get(graph_id, 0) + 1

    # -- kernels -----------------------------------------------------------
    def allgather(self, shard: torch.Tensor, graph_id: int, ds_id: int, dtype) -> torch.Tensor:
        full = self._take_held(shard, graph_id, ds_id, dtype)
        if full is None:
            full = self._gather(shard, graph_id, ds_id, dtype)
        self.gathered[(graph_id, ds_id)] = full
        return full

    def _gather(self, shard: torch.Tensor, graph_id: int, ds_id: int, dtype) -> torch.Tensor:
        # A fresh buffer, as a real all-gather allocates one, so the copy
        # costs memory until the last release frees it.
        return shard.to(dtype=dtype, copy=True) if dtype is not None else shard.clone()

    def _take_held(self, shard: torch.Tensor, graph_id: int, ds_id: int, dtype) -> torch.Tensor | None:
        """The forward's kept buffer of ``ds_id`` for a later graph's gather (None: gather it)."""
        if graph_id == self.plan.forward_graph_id or ds_id not in self.held:
            return None
        held = self.held.pop(ds_id)
        if held.dtype != (dtype if dtype is not None else shard.dtype):
            # Gathered in another precision: a cast back would lose bits, so gather anew.
            held.untyped_storage().resize_(0)
            return None
        return held

    def wait(self, gathered: torch.Tensor, graph_id: int, ds_id: int) -> torch.Tensor:
        return gathered.view_as(gathered)

    def release(self, value: torch.Tensor, graph_id: int, ds_id: int, n_users: int) -> torch.Tensor:
        key = (graph_id, ds_id)
        count = self.release_counts.get(key, 0) + 1
        if count >= n_users:
            self.release_counts.pop(key, None)
            buffer = self.gathered.pop(key, None)
            if buffer is not None and self.plan.kept_in(graph_id, ds_id):
                previous = self.held.get(ds_id)
                if previous is not None and previous is not buffer:  # gathered twice in the forward
                    previous.untyped_storage().resize_(0)
                self.held[ds_id] = buffer
            elif buffer is not None:
                # Free the storage even though views of it may still be
                # referenced, as DeepCompile does; the graph guarantees none
                # of them is read again.
                buffer.untyped_storage().resize_(0)
        else:
            self.release_counts[key] = count
        return value.view_as(value)

    def reduce(self, grad: torch.Tensor, graph_id: int, ds_id: int) -> torch.Tensor:
        reduced = self.in_reduce_dtype(grad, ds_id)
        return reduced.clone() if reduced is grad else reduced

    def transient_bytes(self) -> int:
        """Bytes the latest op held for a moment beyond what it left behind and :meth:`buffers` gives (a
        bucket's flat tensors while its members are copied out of them), then forgotten: a memory tracker
        adds them to what is live after the op for its peak."""
        return 0

    def buffers(self) -> list[torch.Tensor]:
        """Tensors the runtime allocated itself and still holds, which no op returned (a bucket's flat input
        in flight): a memory tracker that sees op outputs only counts these too (:mod:`dcsched.runtime.memtrack`)."""
        return []

    # -- shapes for fake tensors -------------------------------------------
    def gathered_like(self, shard: torch.Tensor, graph_id: int, ds_id: int, dtype) -> torch.Tensor:
        return torch.empty_like(shard, dtype=dtype if dtype is not None else shard.dtype)

    def reduced_shard_like(self, grad: torch.Tensor, graph_id: int, ds_id: int) -> torch.Tensor:
        return torch.empty_like(grad, dtype=self.reduce_dtypes.get(ds_id, grad.dtype))

    def alias_like(self, value: torch.Tensor, *ids) -> torch.Tensor:
        """A wait's or a release's output: a view of its input."""
        return value.view_as(value)


RUNTIME: Zero3Runtime = Zero3Runtime()


def set_runtime(runtime: Zero3Runtime) -> Zero3Runtime:
    """Install ``runtime`` behind the ops; returns the previous one."""
    global RUNTIME
    previous, RUNTIME = RUNTIME, runtime
    return previous


allgather_param = torch.ops.dcsched.allgather_param.default
wait_allgather = torch.ops.dcsched.wait_allgather.default
release_param = torch.ops.dcsched.release_param.default
reduce_grad = torch.ops.dcsched.reduce_grad.default
