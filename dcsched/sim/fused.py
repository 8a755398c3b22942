"""A plan as one simulation reads it: buckets by node, fused times, kept and held parameters.

>>> Fused([-1, 0, 0], {0: 1.5}, 0.5, 1).lead[2], HELD
(0, -2)
"""

from __future__ import annotations

import dataclasses

from dcsched.collective_issue import SIMULATOR, CollectiveIssue


@dataclasses.dataclass(frozen=True)
class Fused:
    """A plan as one simulation reads it: per node its bucket's first member (-1: none; :data:`HELD`: an
    all-gather of a parameter still gathered from the forward), each first member's fused time (ms), the
    communication time the plan saves, the collectives issued, the ds_ids kept gathered past the graph's
    end and the bytes held gathered from its start, and how the run issues its collectives."""

    lead: list[int]
    time: dict[int, float]
    saved_ms: float
    collectives: int
    keep: frozenset = frozenset()
    held_bytes: int = 0
    #: how the collectives are issued (reduce-scatters in flight, staging copies: :class:`CollectiveIssue`)
    issue: CollectiveIssue = SIMULATOR
    #: the first members of the collectives that are all-reduces (replicated gradients: reduced in place)
    all_reduces: frozenset = frozenset()


#: :attr:`Fused.lead` of an all-gather whose parameter is held from the forward: no collective, ready at once.
HELD = -2
