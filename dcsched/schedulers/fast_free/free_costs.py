"""DeepSpeed's free costs of many candidates at once: float sums of one sequence, each without one term.

``fast-free`` breaks ties between all-gathers by the device time of their free
path, summed by DeepSpeed with Python's ``sum``; many all-gathers read by one
node (a concatenation of experts' outputs) tie round after round, and each one's
free path is that node's requirements less the all-gather: one sequence of
times, less one term.
"""

from __future__ import annotations

import sys

import numpy as np

#: Whether Python's ``sum`` of floats adds left to right (before 3.12; from 3.12 it compensates), as
#: :func:`skip_one_folds` does: DeepSpeed sums its free costs with ``sum``.
FOLDS_ARE_SEQUENTIAL = sys.version_info < (3, 12)


def skip_one_folds(times, skipped):
    """For each position in ``skipped`` (increasing), the left-to-right float sum of ``times`` without
    that one term, as ``sum`` adds before Python 3.12; None where a term is negative or not finite.

    The sum without term ``p`` and the one without a later term ``q`` have added the same terms once
    both are past ``q``; so where the first one's running sum after ``q`` equals the second's before
    ``q`` (its start), the two sums are equal. Each running sum therefore advances from one skipped
    position to the next, all of them together (one padded cumulative sum), where it meets the
    sum that starts there (usually at once: rounding keeps them apart only across a power of two); one
    that does not runs on to the end, checked at every later skipped position.

    >>> import numpy as np
    >>> t = np.array([0.1, 0.2, 0.3, 0.1, 0.7])
    >>> [float(v) for v in skip_one_folds(t, np.array([0, 3]))] == [sum(t[1:]), sum([0.1, 0.2, 0.3, 0.7])]
    True
    """
    times = np.asarray(times, dtype=np.float64)
    skipped = np.asarray(skipped, dtype=np.int64)
    k = len(skipped)
    if k == 0:
        return np.zeros(0)
    if not np.all(np.isfinite(times)) or np.any(times < 0):
        return None
    prefix = np.cumsum(times)  # numpy accumulates left to right
    starts = np.where(skipped > 0, prefix[np.maximum(skipped - 1, 0)], 0.0)
    value = np.empty(k)
    value[:-1] = _to_next(times, starts[:-1], skipped)
    value[-1] = np.cumsum(np.concatenate((starts[-1:], times[skipped[-1] + 1:])))[-1]
    equal_to = np.full(k, -1)  # the later sum each one met, if any
    equal_to[:-1] = np.where(value[:-1] == starts[1:], np.arange(1, k), -1)
    for j in np.flatnonzero(equal_to[:-1] < 0).tolist():  # apart there: the rest of the way in full
        base = int(skipped[j + 1])
        running = np.cumsum(np.concatenate(([value[j]], times[base + 1:])))
        later = np.arange(j + 2, k)
        met = later[running[skipped[later] - base] == starts[later]]
        if len(met):
            equal_to[j] = met[0]
        else:
            value[j] = running[-1]
    root = np.where(equal_to >= 0, equal_to, np.arange(k))
    while True:  # follow the links to a sum that met none (pointer doubling)
        further = root[root]
        if np.array_equal(further, root):
            return value[root]
        root = further


def _to_next(times, starts, skipped):
    """Each of ``starts`` (one per skipped position but the last) plus the terms after its skipped
    position up to the next skipped one, that one included, added left to right.

    The short runs as one padded block, a row per run, summed along its rows (padding adds +0.0, which
    changes no sum of non-negative terms); the long ones one at a time.
    """
    after, through = skipped[:-1], skipped[1:]
    lengths = through - after
    result = np.array(starts, dtype=np.float64)
    if not len(lengths):
        return result
    cap = max(64, 8 * len(times) // len(lengths))
    for j in np.flatnonzero(lengths > cap).tolist():
        result[j] = np.cumsum(np.concatenate((result[j:j + 1], times[after[j] + 1:through[j] + 1])))[-1]
    short = np.flatnonzero(lengths <= cap)
    if not len(short):
        return result
    runs = lengths[short]
    width = int(runs.max())
    block = np.zeros((len(short), width + 1))
    block[:, 0] = result[short]
    rows = np.repeat(np.arange(len(short)), runs)
    cols = np.arange(1, len(rows) + 1) - np.repeat(np.cumsum(runs) - runs, runs)
    block[rows, cols] = times[np.repeat(after[short] + 1, runs) + cols - 1]
    result[short] = np.cumsum(block, axis=1)[:, -1]
    return result
