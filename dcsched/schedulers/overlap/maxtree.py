"""A max segment tree for ``overlap``'s placement: add below an index, and the last index above a threshold.

Step 3 adds each placed buffer's size over the slots from its all-gather to
its free, and only ever asks about slots at or after the last all-gather
placed; so adding over every slot before the free instead answers every
question the same, at half a range add's cost.
"""

from __future__ import annotations

import math


class MaxTree:
    """Add below an index, and "last index above a threshold" in a range, over a fixed array (lazy, no
    push-down)."""

    def __init__(self, values: list[float]):
        n = max(1, len(values))
        size = 1
        while size < n:
            size *= 2
        self.size = size
        mx = [-math.inf] * (2 * size)
        mx[size:size + len(values)] = values
        for i in range(size - 1, 0, -1):
            a, b = mx[2 * i], mx[2 * i + 1]
            mx[i] = a if a > b else b
        self.mx = mx
        self.lz: list[float] = [0] * (2 * size)

    def copy(self) -> MaxTree:
        """A tree of the same values (a placement starts from the same capacities several times)."""
        tree = MaxTree.__new__(MaxTree)
        tree.size, tree.mx, tree.lz = self.size, self.mx[:], self.lz[:]
        return tree

    def add_below(self, hi: int, value: float) -> None:
        """Add ``value`` to every index in ``[0, hi)``: one leaf-to-root path (the left sibling of each
        right child on the path of leaf ``hi`` is covered whole)."""
        if hi <= 0:
            return
        mx, lz = self.mx, self.lz
        if hi >= self.size:
            mx[1] += value
            lz[1] += value
            return
        i = hi + self.size
        while i > 1:
            if i & 1:
                mx[i - 1] += value
                lz[i - 1] += value
            i >>= 1
            a, b = mx[2 * i], mx[2 * i + 1]
            mx[i] = (a if a > b else b) + lz[i]

    def last_above(self, lo: int, hi: int, threshold: float) -> int:
        """The largest index in ``[lo, hi)`` whose value exceeds ``threshold``, or -1."""
        return self._last_above(lo, hi, threshold, 1, 0, self.size)

    def _last_above(self, lo, hi, threshold, node, nlo, nhi) -> int:
        if hi <= nlo or nhi <= lo or self.mx[node] <= threshold:
            return -1
        if nhi - nlo == 1:
            return nlo
        mid = (nlo + nhi) // 2
        inner = threshold - self.lz[node]
        found = self._last_above(lo, hi, inner, 2 * node + 1, mid, nhi)
        if found >= 0:
            return found
        return self._last_above(lo, hi, inner, 2 * node, nlo, mid)
