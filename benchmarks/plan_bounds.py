"""How fast a step can be within ``fsdp``'s collective count: a search wider than ``overlap-plan``'s, on MoE.

``overlap-plan`` may issue as many collectives per step as ``fsdp`` does, and on the synthetic MoE steps that
is few (6 with 2 layers: a layer of experts is one unit), while ``overlap`` issues one collective per parameter
and streams the first layer's parameters in as its compute starts. This script asks whether any plan of the
planner's shape reaches ``overlap``'s step within that count, by exhausting a family wider than the planner
searches (no budget, every parameter kept: the fewest collectives):

* forward: every all-gather, in the order the parameters are needed, cut into 1 to 4 consecutive buckets
  (a bucket may hold the end of one layer and the start of the next): at every point among the first 16
  parameters, every third after them; each bucketed on the input order, ``fast-free``'s and ``overlap``'s,
  0, 1 or 2 blocks ahead (``dcsched.schedulers.fsdp.scheduler.bucketed``);
* backward: the reduces in their blocks, the last block whole or cut at every point, on the same orders.

It prints the fastest forward and backward for each collective count and the fastest step within the cap.

    .venv/bin/python benchmarks/plan_bounds.py            # moe-2 (about three minutes)
    .venv/bin/python benchmarks/plan_bounds.py --json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dcsched.graph.form import GraphForm  # noqa: E402
from dcsched.schedulers import run_step  # noqa: E402
from dcsched.schedulers.fast_free.scheduler import fast_free  # noqa: E402
from dcsched.schedulers.fsdp.scheduler import bucketed, step_blocks  # noqa: E402
from dcsched.schedulers.overlap.scheduler import Overlap  # noqa: E402
from dcsched.sim.collectives import DEFAULT_LATENCY_MS  # noqa: E402
from dcsched.sim.plans import simulate_plan  # noqa: E402
from dcsched.sim.simulate import CompiledGraph  # noqa: E402
from dcsched.synthetic import moe_graph  # noqa: E402


def bases(form: GraphForm) -> dict[str, list[int]]:
    """The orders the buckets are made on (node numbers)."""
    index = form.index
    return {"input": list(form.topo), "fast-free": [index[n] for n in fast_free(form).order],
            "overlap": [index[n] for n in Overlap(form).order(math.inf, "all")]}


def splits(members: list[int], most: int, dense: int = 16, stride: int = 3):
    """``members`` cut into 1 to ``most`` consecutive pieces: at every point among the first ``dense``,
    every ``stride``-th after them."""
    points = sorted({*range(1, min(dense, len(members))), *range(dense, len(members), stride)})
    for count in range(most):
        for cuts in itertools.combinations(points, count):
            edges = (0, *cuts, len(members))
            yield [members[a:b] for a, b in zip(edges, edges[1:])]


def fastest(compiled: CompiledGraph, form: GraphForm, groupings, role: dict) -> dict[int, tuple[float, str]]:
    """The fastest step per collective count over ``groupings`` (gathers, reduces), every base and ``ahead``."""
    best: dict[int, tuple[float, str]] = {}
    for name, base in bases(form).items():
        for gathers, reduces in groupings():
            for ahead in (0, 1, 2):
                order, buckets = bucketed(form, base, gathers, reduces, ahead=ahead)
                step, collectives = compiled.timeline_figures(order, buckets=buckets, check=False, **role)
                label = f"{name}, {ahead} ahead, pieces {[len(g) for g in gathers]} / {[len(r) for r in reduces]}"
                if collectives not in best or step < best[collectives][0]:
                    best[collectives] = (step, label)
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    forms = {kind: GraphForm(moe_graph(0, kind=kind, n_layers=2)) for kind in ("forward", "backward")}
    compiled = {k: CompiledGraph(f, comm_latency_ms=DEFAULT_LATENCY_MS) for k, f in forms.items()}
    found = step_blocks(forms, root_mode="joined")
    forward, backward = found["forward"], found["backward"]
    kept = frozenset(forms["forward"].ds_id[m] for g in forward.gathers for m in g)
    first, second = forward.gathers

    def forward_groupings():
        yield from ((pieces, []) for pieces in splits(first + second, 4))

    def backward_groupings():
        *inner, last = backward.reduces
        for tail in splits(last, 2, dense=len(last)):
            yield [g for g in backward.gathers if any(forms["backward"].ds_id[m] not in kept for m in g)], \
                inner + tail

    fwd = fastest(compiled["forward"], forms["forward"], forward_groupings, {})
    bwd = fastest(compiled["backward"], forms["backward"], backward_groupings, {"held": kept})
    figures = {}
    for algo in ("overlap", "fsdp", "overlap-plan"):
        plans = run_step(algo, forms, comm_latency_ms=DEFAULT_LATENCY_MS)
        results = [simulate_plan(compiled[k], plans[k], k, detail=False) for k in forms]
        figures[algo] = (sum(r.step_ms for r in results), sum(r.collectives for r in results))
    cap = figures["fsdp"][1]
    within = [(fwd[f][0] + bwd[b][0], f + b, fwd[f][1], bwd[b][1]) for f in fwd for b in bwd if f + b <= cap]
    best = min(within) if within else None
    if args.json:
        print(json.dumps({"figures": figures, "cap": cap, "forward": fwd, "backward": bwd, "best": best}, indent=1))
        return
    print(f"moe-2, every parameter kept; fsdp's cap: {cap} collectives a step")
    for algo, (step, collectives) in figures.items():
        print(f"  {algo:13s} {step:9.3f} ms  {collectives:4d} collectives")
    for name, table in (("forward", fwd), ("backward", bwd)):
        for count in sorted(table):
            print(f"  fastest {name} with {count} collectives: {table[count][0]:9.3f} ms  ({table[count][1]})")
    if best is not None:
        print(f"fastest step within the cap: {best[0]:.3f} ms with {best[1]} collectives; "
              f"overlap: {figures['overlap'][0]:.3f} ms ({best[0] / figures['overlap'][0] - 1:+.2%})")


if __name__ == "__main__":
    main()
