"""The communication plan against its baselines, by the simulator: issue 32's acceptance table.

For each step (forward and backward graphs planned together) and each budget, one row per algorithm:
``overlap`` (today's orders, every collective alone), ``deepcompile`` (its fused groups run as one collective),
``fsdp`` (FSDP2's per-block buckets, prefetch one block ahead) and ``overlap-plan`` (buckets and kept
parameters chosen within the budget). Figures are the step's: forward plus backward step time, the larger of
the two graphs' peaks (all tensors), collectives per step, and the seconds the scheduler took.

Budgets: the bundle's default (the recorded device's memory less 10%) and 1.1 x the smallest feasible one
(the smallest all-tensor budget ``overlap`` accepts for either graph, from its BudgetError). A baseline that
does not fit a budget is marked ``over``.

Verdicts per step and budget (``overlap-plan`` against each baseline that fits the budget):
``faster``: its step no slower than each's; ``fewer``: its collectives at most ``fsdp``'s (``n/a`` where
``fsdp`` itself does not fit the budget);
``fits``: its peak within the budget; ``at-peak``: given exactly a baseline's own peak as its budget, it is
still no slower than that baseline (no more memory, pairwise), with at most ``fsdp``'s collectives wherever
``fsdp`` fits that budget.

    .venv/bin/python benchmarks/bench_plan.py              # everything
    .venv/bin/python benchmarks/bench_plan.py --quick      # the samples and the small synthetic steps
    .venv/bin/python benchmarks/bench_plan.py --json

With ``--bundle PATH`` it times the schedulers instead, on one bundle's step (e.g. a 70B step captured with
``dcsched profile --meta``): one row per algorithm with the step's nodes, the wall and CPU seconds of loading
the bundle and of ``run_step`` (the scheduler alone), the load average, and the plan's simulated step and
collectives::

    .venv/bin/python benchmarks/bench_plan.py --bundle step.pt --algos overlap-plan,fsdp,fast-free --budget unlimited
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dcsched.budget import Budget, default_budget  # noqa: E402
from dcsched.bundle.core import load  # noqa: E402
from dcsched.errors import BudgetError  # noqa: E402
from dcsched.graph.form import GraphForm  # noqa: E402
from dcsched.schedulers import run_step  # noqa: E402
from dcsched.schedulers.overlap.scheduler import Overlap  # noqa: E402
from dcsched.sim.collectives import DEFAULT_LATENCY_MS, latency_from_provenance  # noqa: E402
from dcsched.sim.plans import simulate_plan  # noqa: E402
from dcsched.sim.simulate import CompiledGraph  # noqa: E402
from dcsched.synthetic import layered_stack, moe_graph  # noqa: E402
from dcsched.synthetic.stacking import stack_copies  # noqa: E402

BASELINES = ("overlap", "deepcompile", "fsdp")
PLANNER = "overlap-plan"
EPS = 1e-9


def steps(quick: bool) -> dict:
    """``{name: (graphs, latency_ms, default budget)}`` for every step benchmarked."""
    found: dict = {}
    for path in sorted((ROOT / "sample_graphs").glob("*.pt")):
        bundle = load(path)
        graphs = {name: bundle.graphs[name] for name in bundle.graph_names}
        found[f"sample:{path.stem}"] = (graphs, latency_from_provenance(bundle.provenance), default_budget(bundle))
        if not quick and path.stem in ("gpt", "llama"):
            for copies in (8, 32):
                stacked = {name: stack_copies(graph, copies) for name, graph in graphs.items()}
                found[f"stacked:{path.stem}x{copies}"] = (stacked, latency_from_provenance(bundle.provenance),
                                                          default_budget(bundle))
    for layers in ((2, 8) if quick else (2, 8, 32)):
        pair = layered_stack(layers)
        found[f"layered-{layers}"] = ({"forward": pair.forward, "backward": pair.backward}, DEFAULT_LATENCY_MS,
                                      Budget.unlimited())
    for layers in ((2,) if quick else (2, 4)):
        moe = {kind: moe_graph(0, kind=kind, n_layers=layers) for kind in ("forward", "backward")}
        found[f"moe-{layers}"] = (moe, DEFAULT_LATENCY_MS, Budget.unlimited())
    return found


def smallest_feasible(forms: dict) -> int:
    """The smallest all-tensor budget ``overlap`` accepts for every graph."""
    return max(Overlap(form).min_budget("all") for form in forms.values())


def measure(forms: dict, compiled: dict, algo: str, budget: Budget, latency: float) -> dict:
    started = time.process_time()
    try:
        plans = run_step(algo, forms, budget=budget, comm_latency_ms=latency)
    except BudgetError:
        return {"algo": algo, "error": "refuses the budget"}
    seconds = time.process_time() - started
    results = {name: simulate_plan(compiled[name], plan, name, check=False) for name, plan in plans.items()}
    kept = sum(1 for where in next(iter(plans.values())).residency.values() if where == "kept")
    return {"algo": algo, "step_ms": sum(r.step_ms for r in results.values()),
            "peak_bytes": max(r.peak_bytes for r in results.values()),
            "collectives": sum(r.collectives for r in results.values()), "kept": kept, "sched_s": seconds}


def bench_step(name: str, graphs: dict, latency: float, default: Budget) -> list[dict]:
    forms = {g: GraphForm(graph) for g, graph in graphs.items()}
    compiled = {g: CompiledGraph(form, comm_latency_ms=latency) for g, form in forms.items()}
    nodes = sum(len(form) for form in forms.values())
    tight = Budget(math.ceil(1.1 * smallest_feasible(forms)), "all")
    rows = []
    for label, budget in (("default", default), ("1.1x min", tight)):
        measured = {algo: measure(forms, compiled, algo, budget, latency) for algo in (*BASELINES, PLANNER)}
        plan = measured[PLANNER]
        fitting = {a: m for a, m in measured.items() if "error" not in m and m["peak_bytes"] <= budget.bytes}
        verdict = {}
        if "error" not in plan:
            verdict["faster"] = all(plan["step_ms"] <= m["step_ms"] + EPS for a, m in fitting.items() if a != PLANNER)
            fsdp = measured["fsdp"]
            # FSDP2's count is the bar where FSDP2's policy runs within the budget; where it does not there
            # is no FSDP2-style plan at that memory to count against (None: shown as n/a)
            verdict["fewer"] = plan["collectives"] <= fsdp["collectives"] if "fsdp" in fitting else None
            verdict["fits"] = plan["peak_bytes"] <= budget.bytes
            at_peak = []
            for algo in BASELINES:
                base = measured[algo]
                if "error" in base:
                    continue
                own = measure(forms, compiled, PLANNER, Budget(base["peak_bytes"], "all"), latency)
                # within fsdp's collectives too, wherever fsdp's plan fits that budget
                counted = "error" in fsdp or fsdp["peak_bytes"] > base["peak_bytes"] or \
                    ("error" not in own and own["collectives"] <= fsdp["collectives"])
                at_peak.append("error" not in own and own["step_ms"] <= base["step_ms"] + EPS and counted)
            verdict["at-peak"] = all(at_peak)
        for algo, m in measured.items():
            over = "error" not in m and m["peak_bytes"] > budget.bytes
            rows.append({"step": name, "nodes": nodes, "budget": label, "budget_bytes": budget.bytes, **m,
                         "over": over, **(verdict if algo == PLANNER else {})})
    return rows


def _verdict(value, no: str = "NO") -> str:
    """``yes``, ``no`` or, for a verdict with nothing to compare against, ``n/a``."""
    return "n/a" if value is None else "yes" if value else no


def _table(rows: list[dict]) -> str:
    keys = ("step", "nodes", "budget", "algo", "step_ms", "peak_MiB", "collectives", "kept", "sched_s", "note")
    cells = []
    for row in rows:
        note = row.get("error", "over budget" if row.get("over") else "")
        if row["algo"] == PLANNER and "faster" in row:
            note = " ".join(f"{k}={_verdict(row[k])}" for k in ("faster", "fewer", "fits", "at-peak"))
        cells.append([row["step"], str(row["nodes"]), row["budget"], row["algo"],
                      f"{row['step_ms']:.3f}" if "step_ms" in row else "-",
                      f"{row['peak_bytes'] / 2**20:.1f}" if "peak_bytes" in row else "-",
                      str(row.get("collectives", "-")), str(row.get("kept", "-")),
                      f"{row['sched_s']:.2f}" if "sched_s" in row else "-", note])
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.ljust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _markdown(rows: list[dict]) -> str:
    """One line per step and budget: each algorithm's step ms / peak MiB / collectives, and the verdicts."""
    lines = ["| step | nodes | budget | overlap | deepcompile | fsdp | overlap-plan (kept) | faster | fewer | fits "
             "| at-peak |", "|---|---:|---|---|---|---|---|---|---|---|---|"]
    keyed: dict = {}
    for row in rows:
        keyed.setdefault((row["step"], row["budget"]), {})[row["algo"]] = row
    for (step, budget), by_algo in keyed.items():
        cells = []
        for algo in (*BASELINES, PLANNER):
            r = by_algo[algo]
            if "error" in r:
                cells.append(r["error"])
                continue
            text = f"{r['step_ms']:.3f} / {r['peak_bytes'] / 2**20:.0f} / {r['collectives']}"
            text += f" ({r['kept']})" if algo == PLANNER else (" over" if r["over"] else "")
            cells.append(text)
        plan = by_algo[PLANNER]
        verdicts = [_verdict(plan.get(k), "**no**") for k in ("faster", "fewer", "fits", "at-peak")]
        lines.append(f"| {step} | {plan['nodes']} | {budget} | " + " | ".join(cells + verdicts) + " |")
    return "\n".join(lines)


def time_bundle(path: str, algos: list[str], budget_text: str | None) -> list[dict]:
    """One row per algorithm: the scheduler's wall and CPU seconds on the bundle's step at ``budget_text``
    (None: the bundle's default budget), and the plan's simulated step (ms) and collectives."""
    wall, cpu = time.perf_counter(), time.process_time()
    bundle = load(path)
    forms = {name: GraphForm(bundle.graphs[name]) for name in bundle.graph_names}
    loaded = {"load_s": time.perf_counter() - wall, "load_cpu_s": time.process_time() - cpu}
    budget = default_budget(bundle) if budget_text is None else Budget.parse(budget_text)
    latency = latency_from_provenance(bundle.provenance)
    rows = []
    for algo in algos:
        # each algorithm on forms of its own: what one computed and kept on a form would flatter the next
        forms = {name: GraphForm(bundle.graphs[name]) for name in bundle.graph_names}
        wall, cpu = time.perf_counter(), time.process_time()
        plans = run_step(algo, forms, budget=budget, comm_latency_ms=latency)
        seconds, cpu_s = time.perf_counter() - wall, time.process_time() - cpu
        compiled = {name: CompiledGraph(forms[name], comm_latency_ms=latency) for name in plans}
        results = [simulate_plan(compiled[name], plan, name, check=False) for name, plan in plans.items()]
        rows.append({"bundle": Path(path).name, "nodes": sum(len(form) for form in forms.values()), "algo": algo,
                     "sched_s": seconds, "sched_cpu_s": cpu_s, **loaded, "load_avg": os.getloadavg()[0],
                     "step_ms": sum(r.step_ms for r in results),
                     "collectives": sum(r.collectives for r in results)})
    return rows


def _timing_table(rows: list[dict]) -> str:
    """:func:`time_bundle`'s rows as a text table."""
    lines = [f"{'bundle':<20} {'nodes':>7} {'algorithm':<14} {'seconds':>8} {'CPU s':>7} {'load s':>7} "
             f"{'load avg':>8} {'step ms':>10} {'collectives':>11}"]
    for r in rows:
        lines.append(f"{r['bundle']:<20} {r['nodes']:>7} {r['algo']:<14} {r['sched_s']:>8.2f} {r['sched_cpu_s']:>7.2f} "
                     f"{r['load_s']:>7.2f} {r['load_avg']:>8.1f} {r['step_ms']:>10.3f} {r['collectives']:>11}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", help="time the schedulers on this bundle's step instead (one row per algorithm)")
    parser.add_argument("--algos", default=f"{PLANNER},fsdp,fast-free", help="with --bundle: comma-separated")
    parser.add_argument("--budget", default=None, help="with --bundle: the memory budget (default: the bundle's)")
    parser.add_argument("--quick", action="store_true", help="the samples and the small synthetic steps")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table (docs/train.md)")
    parser.add_argument("only", nargs="*", help="step names to run (default: all)")
    args = parser.parse_args(argv)
    if args.bundle:
        timed = time_bundle(args.bundle, args.algos.split(","), args.budget)
        print(json.dumps(timed, indent=2) if args.json else _timing_table(timed))
        return
    rows = []
    for name, (graphs, latency, default) in steps(args.quick).items():
        if args.only and name not in args.only:
            continue
        rows += bench_step(name, graphs, latency, default)
        if not args.json:
            print(_table([r for r in rows if r["step"] == name]), flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif args.markdown:
        print(_markdown(rows))


if __name__ == "__main__":
    main()
