"""``overlap-plan``'s step 5: the collectives ``fsdp``'s plan would issue and the plan does not, spent where
they shorten the step (:func:`refine`): blocks cut one at a time, heads cut again, neighbouring blocks merged
where that costs no time; and the refined plan polished, the boundaries before its last reduce blocks moved.
"""

from __future__ import annotations

from typing import Mapping

from dcsched.schedulers.overlap_plan.candidates import REFINED, Candidate, GraphPlanner

#: The most blocks :func:`refine` cuts in a step.
MAX_CUTS = 16
#: The most times :func:`_shift` moves a graph's block boundaries in a row.
MAX_SHIFTS = 4


def refine(planners: dict[str, GraphPlanner], fitting: dict[str, list[Candidate]], kept: frozenset,
           spare: int) -> list[dict[str, Candidate]]:
    """Each graph's plan, spending up to ``spare`` more collectives where they shorten the step; and that
    plan with the boundaries before its last reduce blocks moved.

    Each graph's :data:`REFINED` fastest bucketed candidates may have blocks
    cut (:meth:`GraphPlanner.cuts`): one cut at a time, the one that shortens
    a graph's fastest plan most is made, while one does (and fits
    the planner's budget). When the spare collectives run out, neighbouring blocks
    whose merging costs no time are merged (:meth:`GraphPlanner.merged`),
    and what that frees is spent on cuts again. At most :data:`MAX_CUTS`
    cuts in all. A graph's head may be cut again (:func:`_cut_heads`), which
    takes several collectives at once: after the single cuts, or before them
    with what the merges free first, whichever makes the shorter step.

    The cuts' fixed points may leave a backward's last reduce bucket too long
    to hide behind its end: the plan is then polished (:func:`_polished`),
    the boundaries before the last reduce blocks moved where that shortens
    it, neighbouring blocks merged where that costs no time, and what that
    frees spent on cuts again. Both plans are returned, the refined one first
    (the polished one only where it differs): which is shorter once step 6
    replicates can differ from which is shorter now.
    """
    tried = []
    for heads_first in (False, True):
        best = {name: candidates[0] for name, candidates in fitting.items()}
        current = {name: [c for c in candidates if c.base is not None][:REFINED]
                   for name, candidates in fitting.items()}
        start = _collectives(best)
        if heads_first:  # what merges that cost no time free goes to the heads first
            left = spare + _merge(planners, best, current, kept)
            left -= _cut_heads(planners, best, current, kept, left)
            _single_cuts(planners, best, current, kept, left)
        else:
            left = spare - _single_cuts(planners, best, current, kept, spare)
            _cut_heads(planners, best, current, kept, left)
        tried.append((sum(c.step_ms for c in best.values()), _collectives(best), best, current, start))
    _step, collectives, best, current, start = min(tried, key=lambda t: t[:2])
    refined = dict(best)
    polished = _polished(planners, best, current, kept, spare - (collectives - start))
    return [refined] if polished == refined else [refined, polished]


def _single_cuts(planners: dict[str, GraphPlanner], best: dict[str, Candidate], current: dict[str, list[Candidate]],
                 kept: frozenset, spare: int) -> int:
    """:func:`refine`'s cuts and merges, in place; how many more collectives ``best`` issues after them."""
    start = _collectives(best)
    cuts = _cut(planners, best, current, kept, min(max(0, spare), MAX_CUTS))
    if cuts < MAX_CUTS:
        freed = _merge(planners, best, current, kept)
        _cut(planners, best, current, kept, min(max(0, spare - cuts) + freed, MAX_CUTS - cuts))
    return _collectives(best) - start


def _polished(planners: dict[str, GraphPlanner], best: dict[str, Candidate], current: dict[str, list[Candidate]],
              kept: frozenset, left: int) -> dict[str, Candidate]:
    """:func:`refine`'s plan ``best`` (with ``left`` collectives of the cap unspent) with the boundaries before
    each graph's last reduce blocks moved where that shortens it (:func:`_shift`), then neighbouring blocks
    merged where that costs no time and what that frees spent on cuts and heads, boundaries moved again; in
    place, and returned."""
    _shift(planners, best, current, kept)
    left += _merge(planners, best, current, kept)
    left -= _cut(planners, best, current, kept, min(max(0, left), MAX_CUTS))
    _cut_heads(planners, best, current, kept, left)
    _shift(planners, best, current, kept)
    return best


def _shift(planners: dict[str, GraphPlanner], best: dict[str, Candidate], current: dict[str, list[Candidate]],
           kept: frozenset) -> None:
    """Each graph's ``best`` with the boundaries between its blocks moved (:meth:`GraphPlanner.shifted`) while
    that shortens it within the budget, at most :data:`MAX_SHIFTS` times, in place (the moved candidate takes
    its place in ``current``, or leads it, so later merges and cuts start from it)."""
    for name, planner in planners.items():
        for _ in range(MAX_SHIFTS):
            now = best[name]
            shorter = sorted((t for t in planner.shifted(now, kept) if t.step_ms < now.step_ms - 1e-12),
                             key=Candidate.key)
            moved = next((f for f in map(planner.fitted, shorter) if f is not None), None)
            if moved is None:
                break
            best[name] = moved
            slot = next((k for k, c in enumerate(current[name]) if c is now), None)
            if slot is None:
                current[name] = [moved] + current[name][:REFINED - 1]
            else:
                current[name][slot] = moved


def _merge(planners: dict[str, GraphPlanner], best: dict[str, Candidate], current: dict[str, list[Candidate]],
           kept: frozenset) -> int:
    """Neighbouring blocks merged where that costs no time (:meth:`GraphPlanner.merged`), in ``current`` and,
    where no slower, in ``best``, in place; how many fewer collectives ``best`` issues, to spend where they
    shorten the step."""
    start = _collectives(best)
    for name, planner in planners.items():
        for k, candidate in enumerate(current[name]):
            current[name][k] = planner.merged(candidate, kept)
            if current[name][k].key() <= best[name].key():
                best[name] = current[name][k]
    return start - _collectives(best)


def _collectives(best: Mapping[str, Candidate]) -> int:
    """The step's collectives: every graph's plan's."""
    return sum(c.collectives for c in best.values())


def _cut_heads(planners: dict[str, GraphPlanner], best: dict[str, Candidate], current: dict[str, list[Candidate]],
               kept: frozenset, spare: int) -> int:
    """Cut each graph's head again (:meth:`GraphPlanner.head_cuts`) where that shortens ``best``, within
    ``spare`` more collectives in the step, in place (each new best leads its graph's ``current``, so later
    cuts start from it): the graph whose cut saves most first. Returns how many more collectives
    ``best`` issues."""
    done: set[str] = set()
    added = 0
    while len(done) < len(planners):
        offers = []
        for name, planner in planners.items():
            if name in done:
                continue
            candidates = current[name] + ([] if any(c is best[name] for c in current[name]) else [best[name]])
            room = spare - added
            trials = (t for c in candidates for t in planner.head_cuts(c, kept, room)
                      if t.collectives - best[name].collectives <= room and t.step_ms < best[name].step_ms - 1e-12)
            for trial in sorted(trials, key=Candidate.key):
                fitted = planner.fitted(trial)
                if fitted is not None:
                    offers.append((best[name].step_ms - fitted.step_ms, name, fitted))
                    break
            else:
                done.add(name)
        if not offers:
            break
        _saved, name, trial = max(offers, key=lambda offer: offer[0])
        added += trial.collectives - best[name].collectives
        best[name] = trial
        current[name] = [trial] + current[name][:REFINED - 1]
        done.add(name)
    return added


def _cut(planners: dict[str, GraphPlanner], best: dict[str, Candidate], current: dict[str, list[Candidate]],
         kept: frozenset, most: int) -> int:
    """Make up to ``most`` cuts (:func:`refine`) in ``best`` and ``current``, in place; how many were made."""
    # Each graph's most shortening cut, found again only after a cut in that graph.
    offers: dict[str, tuple[float, int, Candidate] | None] = {}
    for made in range(most):
        for name, planner in planners.items():
            if name in offers:
                continue
            offers[name] = None
            for k, candidate in enumerate(current[name]):
                for trial in planner.cuts(candidate, kept):
                    saved = best[name].step_ms - trial.step_ms
                    offer = offers[name]
                    if saved > 1e-12 and (offer is None or saved > offer[0] + 1e-12):
                        fitted = planner.fitted(trial)
                        if fitted is not None:
                            offers[name] = (saved, k, fitted)
        chosen = max((offer + (name,) for name, offer in offers.items() if offer is not None), default=None,
                     key=lambda offer: offer[0])
        if chosen is None:
            return made
        _saved, k, trial, name = chosen
        current[name][k] = best[name] = trial
        del offers[name]
    return most

