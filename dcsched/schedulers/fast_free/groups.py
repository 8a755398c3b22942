"""``fast-free``'s candidates grouped by last use, and each group's same-size members as one candidate.

All-gathers that share a last use share their tier count (the pending
all-gathers that use waits for), so ``fast-free``'s tier heap holds last uses.
A member that reads only placeholders, has no ancestor all-gather but itself
and whose releases need no all-gather its last use does not need (the usual
case: a fan-in's concatenation reads every member's wait) scores
``(T - size, count, size)``, ``T`` the bytes its last use waits for: only the
largest can win a round, and those tie on every integer part. So they sit in
buckets by size, and a round looks at the largest bucket only, as one
candidate: its best by DeepSpeed's free cost, then name
(:meth:`SizeBuckets.winner`), not at every member (a fan-in of N parameters
took N rounds of N members each). The other members are scored one by one
each round (:attr:`SizeBuckets.scored_alone`).
"""

from __future__ import annotations

import heapq
from typing import Callable

import numpy as np

from dcsched.graph.form import PLACEHOLDER, GraphForm
from dcsched.schedulers.fast_free.free_costs import skip_one_folds
from dcsched.schedulers.fast_free.gather_sets import EMPTY, packed_count, total_size, unpack


class SizeBuckets:
    """The all-gathers of a graph by last use, each last use's bucketable ones by size.

    Parameters
    ----------
    g : GraphForm
    ags : list of int
        The pending all-gathers.
    last : dict of int to int
        Each one's last use.
    anc : dict
        Packed all-gather ancestor sets by node (:mod:`dcsched.schedulers.fast_free.gather_sets`).
    release_mask : dict
        Packed all-gather ancestors of each parameter's releases, by ds_id.
    bucketed : bool
        Whether members may be bucketed at all (else every one is scored alone).
    """

    def __init__(self, g: GraphForm, ags: list[int], last: dict[int, int], anc: dict, release_mask: dict, *,
                 bucketed: bool):
        self.g = g
        self.members: dict[int, list[int]] = {}
        for ag in ags:
            self.members.setdefault(last[ag], []).append(ag)
        self.in_bucket = np.zeros(len(g), dtype=bool)
        # per last use: a heap of its buckets' sizes (negated) and the buckets (pending members) by size
        self.by_size: dict[int, tuple[list[int], dict]] = {}
        self.scored_alone: dict[int, list[int]] = {}
        for use, group in self.members.items():
            at_use = unpack(anc[use])
            buckets: dict[int, list[int]] = {}
            alone = []
            for ag in group:
                extra = unpack(release_mask.get(g.ds_id[ag], EMPTY)) & ~at_use
                if bucketed and use != ag and packed_count(anc[ag]) == 1 and not extra and \
                        all(g.kind[p] == PLACEHOLDER for p in g.preds[ag]):
                    buckets.setdefault(g.size[ag], []).append(ag)
                else:
                    alone.append(ag)
            sizes = [-size for size in buckets]
            heapq.heapify(sizes)
            self.by_size[use] = (sizes, {size: np.array(b, dtype=np.int64) for size, b in buckets.items()})
            for bucket in buckets.values():
                self.in_bucket[bucket] = True
            self.scored_alone[use] = alone
        # The bytes each last use waits for, as last computed: (pending set then, its bytes).
        self.waited: dict[int, tuple[int, int]] = {}
        # Last uses' requirements as first built (node ids, device times), filtered as nodes run.
        self.free_paths: dict[int, tuple] = {}
        self.bucket_mark = np.zeros(len(g), dtype=bool)  # the bucket winner() looks at
        self.name_rank: np.ndarray | None = None

    def pending_member(self, use: int, scheduled: bytearray) -> int | None:
        """A pending all-gather whose last use is ``use`` (None when all of them ran); drops those that ran
        from the end of the member list, so the scan is paid once per member."""
        group = self.members[use]
        while group and scheduled[group[-1]]:
            group.pop()
        return group[-1] if group else None

    def winner(self, use: int, scheduled: bytearray, requirements_of: Callable[[int], list[int]]) -> int | None:
        """The best pending member of the largest bucket of ``use`` (None where it has none): the least
        DeepSpeed free cost, then the least name (the members tie on the rest).

        Each one's free path is ``use``'s requirements less the all-gather itself, and the requirements
        with more nodes scheduled are the earlier requirements less those nodes (the scheduled set only
        grows by whole ancestor sets), so ``use``'s are built once (``requirements_of``) and filtered
        each round; the sums come from :func:`~dcsched.schedulers.fast_free.free_costs.skip_one_folds`.
        """
        sizes, buckets = self.by_size[use]
        done = np.frombuffer(scheduled, dtype=np.uint8)
        while sizes:
            bucket = buckets[-sizes[0]] = buckets[-sizes[0]][done[buckets[-sizes[0]]] == 0]
            if len(bucket):
                break
            del buckets[-heapq.heappop(sizes)]
        else:
            return None
        if len(bucket) == 1:
            return int(bucket[0])
        cached = self.free_paths.get(use)
        if cached is None:
            ids = np.array(requirements_of(use), dtype=np.int64)
            cached = (ids, np.array([self.g.time[v] for v in ids.tolist()]))
        ids, times = cached
        mark = self.bucket_mark
        mark[bucket] = True
        is_member = mark[ids]
        mark[bucket] = False
        # Scheduled nodes leave for good; so do the others of time 0 that no bucket holds, as adding +0.0
        # changes no sum of non-negative terms.
        keep = (done[ids] == 0) & ((times != 0.0) | self.in_bucket[ids])
        ids, times, is_member = ids[keep], times[keep], is_member[keep]
        self.free_paths[use] = (ids, times)
        folds = skip_one_folds(times, np.flatnonzero(is_member))
        least = ids[is_member][folds == folds.min()]
        if len(least) == 1:
            return int(least[0])
        if self.name_rank is None:  # each node's place among the names, sorted as str compares them
            n = len(self.g)
            self.name_rank = np.empty(n, dtype=np.int64)
            self.name_rank[sorted(range(n), key=self.g.names.__getitem__)] = np.arange(n)
        return int(least[np.argmin(self.name_rank[least])])

    def waited_bytes(self, use: int, at_last: int, size_of_bit: list) -> int:
        """The bytes of the pending all-gathers ``at_last`` that ``use`` waits for, from the last figure
        less what ran since (each all-gather subtracted once)."""
        then, total = self.waited.get(use, (0, 0))
        if then:
            total -= total_size(then & ~at_last, size_of_bit)
        else:
            total = total_size(at_last, size_of_bit)
        self.waited[use] = (at_last, total)
        return total
