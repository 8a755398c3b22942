"""The simulator's memory model, in program order: when each storage is freed and the memory series.

:class:`MemoryModel` is a part of :class:`dcsched.sim.simulate.CompiledGraph` (the storage tables it reads
are built there, ``_place_storage``); the rules are in that module's docstring and docs/simulator.md.
"""

from __future__ import annotations

import itertools
import operator
from typing import Sequence

from dcsched.graph.form import ALLGATHER, REDUCE, WAIT
from dcsched.sim.fused import HELD, Fused
from dcsched.sim.staging import staging_series


class MemoryModel:
    """Frees and memory series of an order (node numbers) over the compiled graph's storage tables."""

    # Built by CompiledGraph (dcsched.sim.simulate): the graph's lists, indexed by node number.
    names: list
    kind: list
    ds_id: list
    n_users: list
    owners: list
    owned: list
    part_of: list
    reads: list
    preds: list
    succs: list
    size: list
    readers_of: list
    is_input: list
    alloc: list
    gathered_alloc: list
    gather_or_release: list
    resident_bytes: int
    integral_sizes: bool
    _gather_owners: list | None = None

    def free_positions(self, idx: Sequence[int], owners: Sequence[int] | None = None) -> list[int]:
        """For each node number, the position in ``idx`` after which its storage is freed (-1: never).

        Only storage owners (:attr:`owners`, or those of them given as ``owners``) get a position;
        others get -1.
        """
        n_nodes = len(self.names)
        # Each node's (last) position; a storage root dies after its last reader, found per owner
        # from its readers' positions.
        pos_of = [-1] * n_nodes
        for pos, i in enumerate(idx):
            pos_of[i] = pos
        released = self._released(idx)
        free = [-1] * n_nodes
        part_of, readers, is_input = self.part_of, self.readers_of, self.is_input
        at = pos_of.__getitem__
        for r in self.owners if owners is None else owners:
            p = released.get(r)
            if p is None:
                rs = readers[r]
                p = max(map(at, rs)) if rs else -1
            if part_of[r] >= 0:  # an element of a multi-output op: the tuple holds it too
                rs = readers[part_of[r]]
                if rs:
                    p = max(p, max(map(at, rs)))
            if p < 0 and not is_input[r]:
                p = pos_of[r]  # nobody reads it: freed right after it runs
            free[r] = p
        return free

    @property
    def gather_owners(self) -> list[int]:
        """The all-gathers among the storage :attr:`owners` (what a placement needs the frees of)."""
        owners = self._gather_owners
        if owners is None:
            kind = self.kind
            owners = self._gather_owners = [r for r in self.owners if kind[r] == ALLGATHER]
        return owners

    def _released(self, idx: Sequence[int]) -> dict[int, int]:
        """Position of the release that frees each gathered buffer (its all-gather's number -> position)."""
        kind, ds_id, n_users, tracked = self.kind, self.ds_id, self.n_users, self.gather_or_release
        released: dict[int, int] = {}
        current: dict = {}
        count: dict = {}
        for pos in itertools.compress(range(len(idx)), map(tracked.__getitem__, idx)):
            i = idx[pos]
            if kind[i] == ALLGATHER:
                current[ds_id[i]] = i
                count[ds_id[i]] = 0
            else:
                d = ds_id[i]
                gather = current.get(d)
                if gather is not None:
                    c = count[d] + 1
                    if c >= n_users[i]:
                        released[gather] = pos
                        del current[d]
                    else:
                        count[d] = c
        return released

    def memory_with_frees(self, idx: list[int], *, fused: Fused | None = None) -> tuple[list, list, list[int]]:
        """The memory of all tensors and of gathered buffers while each position of the node numbers
        ``idx`` (unchecked) runs, and :meth:`free_positions`: :meth:`simulate`'s memory model without
        its clocks. With ``fused`` buckets, every member allocates at its bucket's first member; with
        ``fused.issue.staging``, gloo's staging copies count too (:mod:`dcsched.sim.staging`)."""
        kind, owned = self.kind, self.owned
        free = self.free_positions(idx)
        if fused is not None and fused.keep:  # kept gathered buffers outlive the graph
            ds_id, keep = self.ds_id, fused.keep
            for r in self.gather_owners:
                if ds_id[r] in keep:
                    free[r] = -1
        if fused is not None and fused.issue.async_reduce:
            self._reduces_in_flight(idx, free, fused)
        free_all = [0] * len(idx)
        free_gathered = [0] * len(idx)
        for r in self.owners:
            p = free[r]
            if p >= 0:
                free_all[p] += owned[r]
                if kind[r] == ALLGATHER:
                    free_gathered[p] += owned[r]
        memory, gathered = self._memory_series(idx, free_all, free_gathered, fused)
        if fused is not None and fused.issue.staging:  # gloo's own flat copies while its collectives run
            copies = staging_series(idx, kind, owned, self.size, self.preds, self.succs, fused)
            memory = list(map(operator.add, memory, copies))
        return memory, gathered, free

    def _reduces_in_flight(self, idx: list[int], free: list[int], fused: Fused) -> None:
        """Move, in ``free``, each gradient a reduce is its last reader of to where the next reduce-scatter
        is issued (the end for the last): one asynchronous reduce-scatter in flight (:meth:`simulate`)."""
        kind, lead, reads = self.kind, fused.lead, self.reads
        members: dict[int, list[int]] = {}  # issue position -> positions of the reduces it sends
        last_of: dict[int, int] = {}  # a bucket's first member -> position of its last member (where it is issued)
        for pos, i in enumerate(idx):
            if kind[i] == REDUCE:
                last_of[lead[i] if lead[i] >= 0 else i] = pos
        for pos, i in enumerate(idx):
            if kind[i] == REDUCE:
                members.setdefault(last_of[lead[i] if lead[i] >= 0 else i], []).append(pos)
        issues = sorted(members)
        end = len(idx) - 1
        for k, at in enumerate(issues):
            # the next issue waits on this one first, so its buffers are gone before the next allocates
            until = max(at, issues[k + 1] - 1) if k + 1 < len(issues) else end
            for pos in members[at]:
                for x in reads[idx[pos]]:
                    if pos <= free[x] <= at:
                        free[x] = until

    def _memory_series(self, idx: list[int], free_all: list, free_gathered: list,
                       fused: Fused | None = None) -> tuple[list, list]:
        """Memory of all tensors and of gathered buffers while each position's node runs (after it
        allocated, before what it frees)."""
        allocs = list(map(self.alloc.__getitem__, idx))
        gallocs = list(map(self.gathered_alloc.__getitem__, idx))
        start, gstart = self.resident_bytes, 0
        if fused is not None:  # a bucket's members allocate where its first member stands
            lead = fused.lead
            at: dict[int, int] = {}
            start += fused.held_bytes  # held parameters are gathered from the start
            gstart += fused.held_bytes
            for pos, i in enumerate(idx):
                first = lead[i]
                if first == HELD:
                    allocs[pos] = gallocs[pos] = 0
                    continue
                if first < 0:
                    continue
                if first == i:
                    at[i] = pos
                else:
                    p = at[first]
                    allocs[p] += allocs[pos]
                    gallocs[p] += gallocs[pos]
                    allocs[pos] = gallocs[pos] = 0
        if self.integral_sizes:  # exact in any summation order: running sums at C speed
            memory = list(map(operator.sub, itertools.islice(itertools.accumulate(allocs, initial=start), 1, None),
                              itertools.accumulate(free_all, initial=0)))
            gathered = list(map(operator.sub, itertools.islice(itertools.accumulate(gallocs, initial=gstart), 1, None),
                                itertools.accumulate(free_gathered, initial=0)))
            return self._with_bucket_buffers(idx, memory, gathered, fused)
        memory, gathered = [], []
        mem, gmem = start, gstart
        for a, ga, f, gf in zip(allocs, gallocs, free_all, free_gathered):
            if a:
                mem += a
                if ga:
                    gmem += ga
            memory.append(mem)
            gathered.append(gmem)
            if f:
                mem -= f
                gmem -= gf
        return self._with_bucket_buffers(idx, memory, gathered, fused)

    def _with_bucket_buffers(self, idx: list[int], memory: list, gathered: list, fused: Fused | None
                             ) -> tuple[list, list]:
        """``memory`` and ``gathered`` with the flat buffers the runtime holds beside the nodes' own while a
        bucket runs (:mod:`dcsched.runtime.distributed`), in place:

        * an all-gather bucket gathers in place into one flat output (this rank's shards copied into its own
          row of it, as FSDP2 does), which holds the members' bytes (what the nodes own) until its first wait
          allocates each member's own buffer, copies it out (FSDP2's copy-out) and drops the flat output:
          the members' full bytes more at that wait;
        * a reduce bucket copies each member's gradient into one flat input (the gradients' bytes), allocated
          when its first member runs, while the gradients not yet copied are still alive: their bytes more
          at that member (less after, as each copied gradient is freed).
        """
        if fused is None or not fused.time:
            return memory, gathered
        kind, lead, preds, succs, size, owned = self.kind, fused.lead, self.preds, self.succs, self.size, self.owned
        position = {i: p for p, i in enumerate(idx)}
        groups: dict[int, list[int]] = {}
        for i in idx:
            if lead[i] >= 0:
                groups.setdefault(lead[i], []).append(i)
        for first, members in groups.items():
            if len(members) < 2:  # one member left (the rest held or replicated): the runtime runs it alone
                continue
            start = position[first]
            if kind[first] == REDUCE:
                memory[start] += sum(size[preds[m][0]] for m in members)
                continue
            full = sum(owned[m] for m in members)
            waits = [position[w] for m in members for w in succs[m] if kind[w] == WAIT and w in position]
            wait = min(waits, default=start)
            memory[wait] += full
            gathered[wait] += full
        return memory, gathered
