"""Step 3 of ``overlap``: each all-gather at its earliest slot under the budget, in a FIFO sequence.

A :class:`Placement` places one skeleton's all-gathers against one budget's
room: a :class:`~dcsched.schedulers.overlap.maxtree.MaxTree` of each slot's room,
negated, or :data:`NO_LIMIT` for an unlimited budget. It places a plain FIFO
sequence (:meth:`Placement.in_order`: need order, or step 5's reordered
ones) and step 3b's *moving* sequences (:meth:`Placement.moving`):

- *lookahead*: a large all-gather goes ahead of the smaller ones needed before
  it (at most ``lookahead`` places, each at most a ``JUMP_RATIO``-th of its
  size) when placing them first would push it later;
- *passing*: where memory holds an all-gather back, each of the next
  ``passing`` ones that fits before it goes first, if that does not make it
  wait for more compute.

A moving variant places every all-gather exactly as need order does until its
first move, so :meth:`Placement.with_variants` places need order once, asks
at each all-gather whether a variant would move there, and lets each variant
go on alone only from its first move (never, for one that never moves): at
10^5 nodes most variants never move, and each skipped placement is G
segment-tree updates saved.
"""

from __future__ import annotations

#: Step 3b: a large all-gather may pass smaller ones (each at most 1/JUMP_RATIO of its size).
JUMP_RATIO = 4


class NoLimit:
    """The room of an unlimited budget: nothing is ever over it."""

    def add_below(self, hi: int, value: float) -> None:
        pass

    def last_above(self, lo: int, hi: int, threshold: float) -> int:
        return -1

    def copy(self) -> NoLimit:
        return self


NO_LIMIT = NoLimit()


class Placement:
    """Step 3 on one skeleton (an :class:`~dcsched.schedulers.overlap.planner.OverlapPlanner`) against
    one budget's room ``tree``, which the placements fill (one placement per tree).

    All-gather ``k`` may go at slots ``lo[k]`` to ``need[k]``; its buffer
    (``sizes[k]`` bytes) lives from its slot to ``free[k]``.
    """

    def __init__(self, planner, tree):
        self.planner = planner
        self.lo, self.need, self.free = planner.lo, planner.need, planner.free
        self.sizes = planner.gather_sizes
        self.tree = tree

    # -- where one all-gather fits -----------------------------------------------
    def fit(self, k: int, after: int) -> int:
        """All-gather ``k``'s earliest slot, no earlier than ``after``, where its buffer fits the room at
        every slot up to its need (its need slot when none does)."""
        lo, hi = self.lo[k], self.need[k]
        if after > lo:
            lo = after
        if lo >= hi:
            return hi
        blocked = self.tree.last_above(lo, hi, -self.sizes[k])
        return lo if blocked < 0 else blocked + 1

    def fit_beside(self, k: int, after: int, other: int) -> int:
        """:meth:`fit` as if all-gather ``other``'s buffer were placed too (it fills the slots up to its
        free): two questions to the tree instead of placing ``other`` and taking it back."""
        lo, hi = self.lo[k], self.need[k]
        if after > lo:
            lo = after
        if lo >= hi:
            return hi
        cut, z = self.free[other] + 1, self.sizes[k]
        blocked = self.tree.last_above(max(lo, cut), hi, -z) if cut < hi else -1
        if blocked < 0 and lo < cut:
            blocked = self.tree.last_above(lo, min(hi, cut), -z - self.sizes[other])
        return lo if blocked < 0 else blocked + 1

    def _take(self, k: int, slot: int, slots: list[int]) -> None:
        """Place all-gather ``k`` at ``slot``: its buffer fills the room up to its free."""
        if self.sizes[k]:
            self.tree.add_below(self.free[k] + 1, self.sizes[k])
        slots[k] = slot

    # -- sequences -------------------------------------------------------------------
    def in_order(self, sequence, slots: list[int]) -> None:
        """A plain FIFO ``sequence``: each all-gather at its :meth:`fit`, no earlier than the one before
        it (recorded in ``slots``)."""
        prev = 0
        if self.tree is NO_LIMIT:  # fit inlined: the first slot allowed
            lo_of, need = self.lo, self.need
            for k in sequence:
                p, hi = lo_of[k], need[k]
                if prev > p:
                    p = prev
                if p >= hi:
                    p = hi
                slots[k] = p
                if p > prev:
                    prev = p
            return
        fit, add, free, sizes = self.fit, self.tree.add_below, self.free, self.sizes
        for k in sequence:
            p = fit(k, prev)
            if sizes[k]:
                add(free[k] + 1, sizes[k])
            slots[k] = p
            if p > prev:
                prev = p

    def moving(self, pending: list[int], prev: int, slots: list[int], used: list[int], lookahead: int,
               passing: int) -> None:
        """Step 3b from the stack ``pending`` (the next all-gather last), the FIFO's last slot so far
        ``prev``: each all-gather, or one that jumps ahead of it, at its :meth:`fit`, and any that pass
        it; ``used`` gets the FIFO sequence."""
        fit, lo_of = self.fit, self.lo
        while pending:
            k = pending[-1]
            p = fit(k, prev)
            back = self._jump(k, p, prev, [pending[-b] for b in range(2, min(lookahead, len(pending) - 1) + 2)])
            if back is None:
                pending.pop()
            else:  # the back-th pending one goes first; k stays next
                k = pending.pop(-2 - back)
                p = fit(k, prev)
            if passing and p > max(lo_of[k], prev):
                p, prev = self._pass(k, p, prev, pending, passing, slots, used)
            self._take(k, p, slots)
            used.append(k)
            prev = max(prev, p)

    def with_variants(self, variants: list[tuple[int, int]]) -> tuple[list[int], list]:
        """Need order's slots, and per moving variant ``(lookahead, passing)`` its ``(slots, FIFO
        sequence)``, or None where it places every all-gather as need order does.

        Each variant follows need order's placement until the first all-gather
        where it would move; from there it goes on alone, on a copy of the room
        as it was at that all-gather.
        """
        n = len(self.need)
        slots = [0] * n
        following = list(range(len(variants)))
        forks = []
        prev = 0
        for k in range(n):
            p = self.fit(k, prev)
            for v in [v for v in following if self._moves_at(k, p, prev, *variants[v])]:
                forks.append((v, k, self.tree.copy(), slots[:], prev))
                following.remove(v)
            self._take(k, p, slots)
            if p > prev:
                prev = p
        placed: list[tuple[list[int], list[int]] | None] = [None] * len(variants)
        for v, first, tree, own_slots, own_prev in forks:
            used = list(range(first))
            Placement(self.planner, tree).moving(list(range(n - 1, first - 1, -1)), own_prev, own_slots, used,
                                                 *variants[v])
            placed[v] = (own_slots, used)
        return slots, placed

    # -- step 3b's moves -------------------------------------------------------------
    def _jump(self, k: int, p: int, prev: int, ahead) -> int | None:
        """Lookahead: which of ``ahead`` (the next all-gathers, nearest first) goes before ``k``, placed at
        ``p``, as its index there; None for none. One that is far larger goes first where waiting
        behind ``k`` would place it later."""
        sizes = self.sizes
        for index, j in enumerate(ahead):
            if sizes[j] > JUMP_RATIO * sizes[k] and self.fit(j, prev) < self.fit_beside(j, max(prev, p), k):
                return index
        return None

    def _passer(self, j: int, k: int, p: int, prev: int) -> tuple[int, int] | None:
        """Passing: whether all-gather ``j`` goes before ``k``, which memory holds back to ``p``: it fits
        earlier and ``k`` then waits for no more compute (``work``: compute before a slot). Returns
        ``j``'s slot and ``k``'s, or None."""
        work = self.planner.slot_work
        pj = self.fit(j, prev)
        if work[pj] >= work[p]:
            return None
        after = self.fit_beside(k, max(prev, pj), j)
        return None if work[after] > work[p] + 1e-12 else (pj, after)

    def _pass(self, k, p, prev, pending, passing, slots, used) -> tuple[int, int]:
        """Each of the next ``passing`` pending all-gathers that :meth:`_passer` lets go before ``k`` is
        placed (``slots``, ``used``, the room); returns ``k``'s slot and the FIFO's last slot so far."""
        for j in [pending[-back] for back in range(1, min(passing, len(pending)) + 1)]:
            passed = self._passer(j, k, p, prev)
            if passed is None:
                continue
            pj, p = passed
            del pending[len(pending) - 1 - pending[::-1].index(j)]
            self._take(j, pj, slots)
            used.append(j)
            prev = max(prev, pj)
        return p, prev

    def _moves_at(self, k: int, p: int, prev: int, lookahead: int, passing: int) -> bool:
        """Whether a variant that has placed need order so far moves at all-gather ``k`` (need order
        would place it at ``p``)."""
        n = len(self.need)
        if lookahead and self._jump(k, p, prev, range(k + 1, min(k + 1 + lookahead, n))) is not None:
            return True
        return bool(passing) and p > max(self.lo[k], prev) and any(
            self._passer(j, k, p, prev) is not None for j in range(k + 1, min(k + 1 + passing, n)))
