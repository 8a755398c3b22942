"""A max segment tree for ``overlap``'s placement: range add, and the last index above a threshold."""

from __future__ import annotations

import math


class MaxTree:
    """Range add, range max, and "last index above a threshold" over a fixed array (lazy, no push-down)."""

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
        self.lz = [0] * (2 * size)

    def add(self, lo: int, hi: int, value: float) -> None:
        """Add ``value`` to every index in ``[lo, hi)`` (bottom-up, then the two boundary paths)."""
        if lo >= hi:
            return
        mx, lz = self.mx, self.lz
        lo += self.size
        hi += self.size
        left, right = lo, hi - 1
        while lo < hi:
            if lo & 1:
                mx[lo] += value
                lz[lo] += value
                lo += 1
            if hi & 1:
                hi -= 1
                mx[hi] += value
                lz[hi] += value
            lo >>= 1
            hi >>= 1
        for i in (left >> 1, right >> 1):
            while i:
                a, b = mx[2 * i], mx[2 * i + 1]
                mx[i] = (a if a > b else b) + lz[i]
                i >>= 1

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
