"""One digest of every registered scheduler's plans on the shipped and synthetic graphs.

A structure change (modules moved, values passed in another form) must leave every plan as it was: run this
before and after and compare the last line. The graphs are the sample bundles, layered stacks of 1, 3 and 8
layers (tied and untied), MoE and random ZeRO-3 graphs of seeds 0-3; each scheduler runs the forward and
backward as a step at the default budget and with no limit. A plan is its order, its buckets and its
residency; a refusal counts by its message.

    python tools/plan_digest.py            # one line per (graph, scheduler, budget), then TOTAL <digest>
    python tools/plan_digest.py --total    # the TOTAL line alone
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def steps() -> dict[str, dict]:
    """Graph name -> {"forward": GraphForm, "backward": GraphForm}."""
    import dcsched
    from dcsched.graph.form import GraphForm
    from dcsched.synthetic import layered_stack, moe_graph, random_graph

    found: dict[str, dict] = {}
    for path in sorted((ROOT / "sample_graphs").glob("*.pt")):
        bundle = dcsched.load(path)
        found[path.name] = {name: GraphForm(graph) for name, graph in bundle.graphs.items()}
    for layers in (1, 3, 8):
        for tied in (True, False):
            stack = layered_stack(layers, tied=tied)
            found[f"stack{layers}{tied}"] = {"forward": GraphForm(stack.forward), "backward": GraphForm(stack.backward)}
    for seed in range(4):
        found[f"moe{seed}"] = {"forward": GraphForm(moe_graph(seed)),
                               "backward": GraphForm(moe_graph(seed, kind="backward"))}
        found[f"rand{seed}"] = {"forward": GraphForm(random_graph(seed)),
                                "backward": GraphForm(random_graph(seed, kind="backward"))}
    return found


def plan_text(plan) -> str:
    """What makes two plans the same: the order, each bucket's kind and members, the residency."""
    buckets = tuple((bucket.kind, tuple(bucket.members)) for bucket in plan.buckets)
    return repr((tuple(plan.order), buckets, sorted(dict(plan.residency).items())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total", action="store_true", help="print the TOTAL line alone")
    args = parser.parse_args(argv)
    from dcsched.budget import Budget
    from dcsched.errors import DcschedError
    from dcsched.schedulers import available, run_step

    total = hashlib.sha256()
    for name, forms in steps().items():
        for algo in available():
            for which, budget in enumerate((None, Budget.unlimited())):
                try:
                    plans = run_step(algo, forms, budget=budget)
                    key = "|".join(f"{graph}:{plan_text(plan)}" for graph, plan in sorted(plans.items()))
                except DcschedError as exc:
                    key = f"error {type(exc).__name__} {exc}"
                digest = hashlib.sha256(key.encode()).hexdigest()[:12]
                total.update(f"{name} {algo} {which} {digest}\n".encode())
                if not args.total:
                    print(name, algo, which, digest, flush=True)
    print("TOTAL", total.hexdigest()[:16])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
