"""Schedule quality: every algorithm's memory and simulated step time per graph, and issue 5's targets.

For each graph (the sample bundles, and captured GPT, Llama and ConvNet stacks
of 8, 32 and 80 layers profiled with the analytic H100 cost model, forward and
backward) one table row per algorithm: all-tensor peak, gathered peak, step
time, overlap, and the step time over both lower bounds (``simple`` =
max(compute, communication); ``tight`` = :func:`dcsched.sim.bounds.tight_bound`, the
largest of the simulator's tight bound, :func:`dcsched.sim.bounds.through_comm_bound`
and :func:`dcsched.sim.bounds.ends_bound`). Algorithms:
``none``, ``list``, ``simple-prefetch``, ``fast-free``, ``prefetch-ahead`` for
k = 1, 2, 4, 8, and ``overlap`` at B = max(fast-free's gathered peak, 2 x the
largest all-gather), at exactly fast-free's gathered peak, and unlimited.
Below each graph: PASS/FAIL per target of issue 5 (see docs/overlap.md); a
missed target that no order can meet within the budget (``budget_bound``) is
OUT OF REACH instead of FAIL, and the graph's verdict PASS*.

Everything is measured with dcsched's simulator. ``sched s`` is the CPU time
(``time.process_time``) of computing the order (for ``overlap``: setup plus one
budget), so a busy machine does not inflate it. Captured bundles are cached in
``benchmarks/.cache/`` (see ``quality_graphs.py``; a missing one is captured
first, which takes minutes on 2 cores).

    .venv/bin/python benchmarks/bench_quality.py              # everything
    .venv/bin/python benchmarks/bench_quality.py --quick      # samples and each architecture's shallowest stack
    .venv/bin/python benchmarks/bench_quality.py gpt-32 sample:gpt
    .venv/bin/python benchmarks/bench_quality.py --stress     # also convnet_down (see quality_graphs.STRESS)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality_graphs import CONFIGS, STRESS, captured, depths, samples  # noqa: E402

from dcsched.sim.bounds import budget_bound, tight_bound  # noqa: E402
from dcsched.sim.plans import simulate_plan  # noqa: E402
from dcsched.graph.nxview import to_networkx  # noqa: E402
from dcsched.schedulers import run  # noqa: E402
from dcsched.graph.form import GraphForm, paused_gc  # noqa: E402
from dcsched.schedulers.deepcompile import DeepCompile  # noqa: E402
from dcsched.schedulers.overlap.scheduler import UNLIMITED, Overlap  # noqa: E402
from dcsched.units import format_bytes  # noqa: E402

AHEAD = (1, 2, 4, 8)
BASELINES = ("none", "list", "simple-prefetch", "fast-free")
EPS = 1e-9
PIPELINES = ("deepcompile", "deepcompile @B", "deepcompile @ff")


def _tolerance(layers: int | None, at_32: float, at_8: float) -> float | None:
    if layers is None or layers < 8:
        return None
    return at_32 if layers >= 32 else at_8


@dataclasses.dataclass
class Runs:
    """One graph's orders by every algorithm at its budgets, simulated: what the targets are checked on."""

    scheduler: Overlap
    tight: float
    budget_b: float
    bound_b: float
    rows: list = dataclasses.field(default_factory=list)
    results: dict = dataclasses.field(default_factory=dict)
    #: DeepCompile pipeline label -> (its step, overlap's at its all-tensor peak), as check_targets found them.
    vs_pipeline: dict = dataclasses.field(default_factory=dict)

    def add(self, label: str, order_indices=None, names=None, seconds=None, budget=None, plan=None):
        """Simulate an order (node numbers or names), or a plan with its buckets as ``dcsched schedule`` does."""
        compiled = self.scheduler.compiled
        if plan is not None:
            result = simulate_plan(compiled, plan, "forward", detail=False)
        else:
            result = compiled.simulate(names if names is not None else order_indices, detail=False)
        self.results[label] = result
        self.rows.append(dict(algo=label, peak=result.peak_bytes, gathered=result.gathered_peak_bytes,
                              step=result.step_ms, overlap=result.overlap_pct,
                              vs_simple=result.step_ms / compiled.bounds.simple, vs_tight=result.step_ms / self.tight,
                              seconds=seconds, budget=budget))
        return result


def run_algorithms(name: str, graph) -> Runs:
    """Every baseline, DeepCompile's pipeline at three budgets, prefetch-ahead(k) and overlap at B, ff and unlimited."""
    view = to_networkx(graph)
    started = time.process_time()
    with paused_gc():  # as the registered scheduler runs
        scheduler = Overlap(view, name=name)
    setup_s = time.process_time() - started
    compiled = scheduler.compiled
    runs = Runs(scheduler, tight_bound(compiled), 0.0, 0.0)
    for algo in BASELINES:
        t = time.process_time()
        order = list(run(algo, GraphForm(view)).order)
        runs.add(algo, names=order, seconds=time.process_time() - t)
    ff = runs.results["fast-free"]
    runs.budget_b = budget_b = max(ff.gathered_peak_bytes, 2 * scheduler.largest_gather)
    # DeepCompile's pipeline: with DeepSpeed's budget (the device, unlimited for these graphs: only its
    # 4e9-byte buffer cap holds prefetches back), at fast-free's all-tensor peak plus what B adds over
    # fast-free's gathered peak, and at fast-free's all-tensor peak.
    t = time.process_time()
    pipeline = DeepCompile(view)
    setup = time.process_time() - t
    for label, budget in (("deepcompile", None), ("deepcompile @B", ff.peak_bytes + budget_b - ff.gathered_peak_bytes),
                          ("deepcompile @ff", ff.peak_bytes)):
        t = time.process_time()
        runs.add(label, plan=pipeline.scheduled(math.inf if budget is None else budget),
                 seconds=time.process_time() - t + setup, budget=budget)
    planner = scheduler.planners[0]
    for k in AHEAD:
        runs.add(f"prefetch-ahead k={k}", order_indices=planner.assemble(planner.ahead_slots(k)))
    runs.bound_b = max(runs.tight, budget_bound(compiled, budget_b))
    for label, budget in (("overlap @B", budget_b), ("overlap @ff", ff.gathered_peak_bytes),
                          ("overlap unlimited", UNLIMITED)):
        t = time.process_time()
        if budget >= scheduler.min_budget():
            with paused_gc():
                order, _ = scheduler.plan(budget)
            runs.add(label, order_indices=order, seconds=time.process_time() - t + setup_s, budget=budget)
        else:
            runs.rows.append(dict(algo=label, budget=budget, infeasible=True))
    return runs


def check_targets(runs: Runs, layers: int | None) -> list[tuple[str, str, str]]:
    """The targets' verdicts on ``runs``: (target, PASS/FAIL/OUT OF REACH/n/a, detail)."""
    scheduler, results, budget_b, tight = runs.scheduler, runs.results, runs.budget_b, runs.tight
    ff = results["fast-free"]
    verdicts: list[tuple[str, str, str]] = []

    def verdict(target: str, ok: bool | None, detail: str, out_of_reach: bool = False):
        status = "n/a" if ok is None else ("PASS" if ok else ("OUT OF REACH" if out_of_reach else "FAIL"))
        verdicts.append((target, status, detail))
    at_b, at_ff, unlimited = results.get("overlap @B"), results.get("overlap @ff"), results.get("overlap unlimited")
    # 1. At B.
    if at_b is None:
        verdict("B: fits", False, f"B={format_bytes(budget_b)} below overlap's minimum")
    else:
        cap = ff.peak_bytes + (budget_b - ff.gathered_peak_bytes)
        verdict("B: gathered <= B", at_b.gathered_peak_bytes <= budget_b,
                f"{format_bytes(at_b.gathered_peak_bytes)} <= {format_bytes(budget_b)}")
        verdict("B: peak <= ff + (B - ff gathered)", at_b.peak_bytes <= cap,
                f"{format_bytes(at_b.peak_bytes)} <= {format_bytes(cap)}")
        tol = _tolerance(layers, 0.01, 0.03)
        ratio = at_b.step_ms / unlimited.step_ms
        # No order at all can beat budget_bound within B: past 1 + tol, the target is out of reach.
        floor = runs.bound_b / unlimited.step_ms
        verdict(f"B: step within {'n/a' if tol is None else f'{tol:.0%}'} of unlimited",
                None if tol is None else ratio <= 1 + tol + EPS,
                f"{ratio:.4f}x; no order within B can be under {floor:.4f}x (budget bound)",
                out_of_reach=tol is not None and floor > 1 + tol)
    # 2. At fast-free's gathered peak.
    if at_ff is not None:
        verdict("ff peak: step <= fast-free", at_ff.step_ms <= ff.step_ms + EPS,
                f"{at_ff.step_ms:.3f} vs {ff.step_ms:.3f} ms")
        verdict("ff peak: peak <= fast-free", at_ff.peak_bytes <= ff.peak_bytes,
                f"{format_bytes(at_ff.peak_bytes)} vs {format_bytes(ff.peak_bytes)}")
    else:
        verdict("ff peak: feasible", False, "fast-free's gathered peak is below overlap's minimum")
    # 3. Unlimited vs the tighter bound.
    tol = _tolerance(layers, 0.02, 0.05)
    ratio = unlimited.step_ms / tight
    verdict(f"unlimited: within {'n/a' if tol is None else f'{tol:.0%}'} of tight bound",
            None if tol is None else ratio <= 1 + tol + EPS, f"{ratio:.4f}x")
    # 4. At equal or lower gathered peak, never slower than fast-free / simple-prefetch / prefetch-ahead(k).
    for other in ["fast-free", "simple-prefetch"] + [f"prefetch-ahead k={k}" for k in AHEAD]:
        theirs = results[other]
        budget = theirs.gathered_peak_bytes
        if budget < scheduler.min_budget():
            verdict(f"<= {other} at its gathered peak", None,
                    f"its gathered peak {format_bytes(budget)} < overlap's minimum "
                    f"{format_bytes(scheduler.min_budget())}"
                    " (a different compute order)")
            continue
        _, mine = scheduler.plan(budget)
        verdict(f"<= {other} at its gathered peak", mine.step_ms <= theirs.step_ms + EPS,
                f"{mine.step_ms:.3f} vs {theirs.step_ms:.3f} ms at {format_bytes(budget)}")
    # 5. At the all-tensor peak of DeepCompile's pipeline (scope all): within it, no slower than it.
    tol = _tolerance(layers, 0.01, 0.03)
    vs_pipeline = runs.vs_pipeline
    for other in PIPELINES:
        theirs = results[other]
        budget = theirs.peak_bytes
        target = f"all-tensor scope at {other}'s peak: fits" + ("" if tol is None else f", <= {other} + {tol:.0%}")
        if budget < scheduler.min_budget("all"):
            verdict(target, False, f"its peak {format_bytes(budget)} < overlap's minimum "
                                   f"{format_bytes(scheduler.min_budget('all'))}")
            continue
        _, mine = scheduler.plan(budget, "all")
        ratio = mine.step_ms / theirs.step_ms
        verdict(target, mine.peak_bytes <= budget and (tol is None or ratio <= 1 + tol + EPS),
                f"{mine.step_ms:.3f} vs {theirs.step_ms:.3f} ms ({ratio:.4f}x), peak {format_bytes(mine.peak_bytes)}"
                f" <= {format_bytes(budget)}")
        vs_pipeline[other] = (theirs.step_ms, mine.step_ms)
    if at_b is not None:
        fitting = [f"prefetch-ahead k={k}" for k in AHEAD
                   if results[f"prefetch-ahead k={k}"].gathered_peak_bytes <= budget_b]
        best = min((results[o].step_ms for o in fitting), default=math.inf)
        verdict("B: <= every prefetch-ahead(k) fitting B", at_b.step_ms <= best + EPS,
                f"{at_b.step_ms:.3f} vs best {best:.3f} ms ({len(fitting)} of {len(AHEAD)} fit)")
    return verdicts


def summary(name: str, runs: Runs, verdicts) -> dict:
    """The graph's header row: its size, bounds, and the compact figures of the summary tables."""
    scheduler, results, budget_b, tight = runs.scheduler, runs.results, runs.budget_b, runs.tight
    compiled, ff = scheduler.compiled, results["fast-free"]
    at_b, at_ff, unlimited = results.get("overlap @B"), results.get("overlap @ff"), results.get("overlap unlimited")
    vs_pipeline = runs.vs_pipeline
    fitting_b = [results[f"prefetch-ahead k={k}"].step_ms for k in AHEAD
                 if results[f"prefetch-ahead k={k}"].gathered_peak_bytes <= budget_b]
    compact = dict(graph=name, tight=tight, ff=ff.step_ms, sp=results["simple-prefetch"].step_ms,
                   ahead=min(fitting_b, default=math.inf), at_b=at_b.step_ms if at_b else math.inf,
                   at_b_gathered=at_b.gathered_peak_bytes if at_b else None, budget_b=budget_b, bound_b=runs.bound_b,
                   at_ff=at_ff.step_ms if at_ff else math.inf, unlimited=unlimited.step_ms,
                   seconds=next(r["seconds"] for r in runs.rows if r["algo"] == "overlap @B"), vs_pipeline=vs_pipeline,
                   verdict="FAIL" if any(v[1] == "FAIL" for v in verdicts) else
                   ("PASS*" if any(v[1] == "OUT OF REACH" for v in verdicts) else "PASS"))
    header = dict(graph=name, nodes=len(compiled), compact=compact, gathers=compiled.num_allgathers,
                  simple=compiled.bounds.simple, tight=tight,
                  sim_tight=compiled.bounds.tight, budget_b=budget_b, min_budget=scheduler.min_budget())
    return header


def evaluate(name: str, graph, layers: int | None) -> tuple[list[dict], list[tuple[str, str, str]]]:
    """Rows (one per algorithm, after the graph's header) and target verdicts (target, status, detail) for one graph."""
    runs = run_algorithms(name, graph)
    verdicts = check_targets(runs, layers)
    return [summary(name, runs, verdicts)] + runs.rows, verdicts


def render(rows: list[dict], verdicts) -> str:
    head = rows[0]
    lines = [f"\n## {head['graph']}: {head['nodes']} nodes, {head['gathers']} all-gathers; lower bounds: "
             f"simple {head['simple']:.3f} ms, tight {head['tight']:.3f} ms (simulator's {head['sim_tight']:.3f}); "
             f"B = {format_bytes(head['budget_b'])}, overlap's minimum = {format_bytes(head['min_budget'])}",
             f"| {'algorithm':22s} | {'peak':>11s} | {'gathered':>11s} | {'step ms':>9s} | {'overlap':>7s} "
             f"| {'/simple':>7s} | {'/tight':>7s} | {'sched s':>7s} |",
             "|" + "|".join("-" * w for w in (24, 13, 13, 11, 9, 9, 9, 9)) + "|"]
    for r in rows[1:]:
        if r.get("infeasible"):
            lines.append(f"| {r['algo']:22s} | budget {format_bytes(r['budget'])} below overlap's minimum |")
            continue
        secs = "" if r["seconds"] is None else f"{r['seconds']:.3f}"
        lines.append(f"| {r['algo']:22s} | {format_bytes(r['peak']):>11s} | {format_bytes(r['gathered']):>11s} "
                     f"| {r['step']:9.3f} | {r['overlap']:6.1f}% | {r['vs_simple']:7.3f} | {r['vs_tight']:7.3f} "
                     f"| {secs:>7s} |")
    lines.append("")
    for target, status, detail in verdicts:
        lines.append(f"- {status:4s} {target}: {detail}")
    return "\n".join(lines)


def graphs(selection: list[str], quick: bool, stress: bool = False):
    wanted = set(selection)
    for name, bundle in samples().items():
        if not wanted or name in wanted:
            yield name, bundle, None
    archs = list(CONFIGS) + list(STRESS)
    for n in sorted({d for arch in archs for d in depths(arch)}):
        for arch in archs:
            key = f"{arch}-{n}"
            if n not in depths(arch) or (quick and n > min(depths(arch))):
                continue
            if (key in wanted) or (not wanted and (arch in CONFIGS or stress)):
                yield key, captured(arch, n), n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graphs", nargs="*", help="sample:<name> or <arch>-<layers> (default: all)")
    parser.add_argument("--quick", action="store_true", help="samples and each architecture's shallowest stack only")
    parser.add_argument("--stress", action="store_true", help="also the stress configurations (quality_graphs.STRESS)")
    args = parser.parse_args(argv)
    totals: dict[str, int] = {}
    failures = []
    compact = []
    for name, bundle, layers in graphs(args.graphs, args.quick, args.stress):
        for part, graph in bundle.graphs.items():
            label = f"{name} {part}"
            rows, verdicts = evaluate(label, graph, layers)
            compact.append(rows[0]["compact"])
            print(render(rows, verdicts), flush=True)
            for target, status, detail in verdicts:
                totals[status] = totals.get(status, 0) + 1
                if status in ("FAIL", "OUT OF REACH"):
                    failures.append(f"{status} {label}: {target} ({detail})")
    print("\n## Step time (ms) per graph; overlap's over the tight bound in brackets\n")
    print("| graph | tight bound | fast-free | simple-prefetch | best ahead(k) fitting B | B | bound within B "
          "| overlap @B | overlap @ff peak | overlap unlimited | overlap s (CPU) | targets |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in compact:
        print(f"| {c['graph']} | {c['tight']:.3f} | {c['ff']:.3f} | {c['sp']:.3f} | {c['ahead']:.3f} "
              f"| {format_bytes(c['budget_b'])} | {c['bound_b']:.3f} | {c['at_b']:.3f} ({c['at_b'] / c['tight']:.3f}) "
              f"| {c['at_ff']:.3f} ({c['at_ff'] / c['tight']:.3f}) "
              f"| {c['unlimited']:.3f} ({c['unlimited'] / c['tight']:.3f}) "
              f"| {c['seconds']:.2f} | {c['verdict']} |")
    print("\n## DeepCompile's pipeline against overlap (scope all) at the pipeline's all-tensor peak, step ms\n")
    print("| graph | " + " | ".join(f"{p} | overlap at its peak | ratio" for p in PIPELINES) + " |")
    print("|---|" + "---|---|---|" * len(PIPELINES))
    for c in compact:
        cells = []
        for other in PIPELINES:
            theirs, mine = c["vs_pipeline"].get(other, (math.nan, math.nan))
            cells.append(f"{theirs:.3f} | {mine:.3f} | {mine / theirs:.4f}")
        print(f"| {c['graph']} | " + " | ".join(cells) + " |")
    print("\n## Summary: " + ", ".join(f"{k} {v}" for k, v in sorted(totals.items())))
    for line in failures:
        print(f"- {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
