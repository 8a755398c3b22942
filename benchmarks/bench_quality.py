"""Schedule quality: every algorithm's memory and simulated step time per graph, checked against fixed targets.

Two comparisons, each like for like.

**Orders** (no buckets: one collective per all-gather and per reduce). For each
graph (the sample bundles, and captured GPT, Llama, ConvNet, Mixtral and ViT
stacks profiled with the analytic H100 cost model, forward and backward) one
table row per algorithm: all-tensor peak, gathered peak, step time, overlap,
collectives issued, and the step time over both lower bounds (``simple`` =
max(compute, communication); ``tight`` = :func:`dcsched.sim.bounds.tight_bound`,
the largest of the simulator's tight bound, :func:`dcsched.sim.bounds.through_comm_bound`
and :func:`dcsched.sim.bounds.ends_bound`). Both are bounds for unbucketed
orders: a plan whose buckets fuse collectives pays fewer latencies and can
go under them. Order rows: ``none``, ``list``, ``simple-prefetch``,
``fast-free``, ``prefetch-ahead`` for k = 1, 2, 4, 8, ``deepcompile order``
(DeepCompile's pipeline, ``deepcompile``, its order run without its fused
groups) at three all-tensor budgets (unlimited, ``@B``, ``@ff``), and
``overlap`` at B = max(fast-free's gathered peak, 2 x the largest
all-gather), at exactly fast-free's gathered peak, and unlimited. Below each
graph: PASS/FAIL per order target; a missed target that no order can meet
within the budget (``budget_bound``) is OUT OF REACH instead of FAIL, and the
graph's verdict PASS*.

**Plans** (order, buckets and residency, over the step). ``deepcompile plan``
rows are the same pipeline runs with their fused groups as buckets, each
bucket one collective paying one latency, as ``dcsched schedule`` simulates
them (:func:`dcsched.sim.plans.simulate_plan`). dcsched's bucketing planner,
``overlap-plan``, is a step scheduler: it plans forward and backward together
(a parameter kept gathered costs forward memory and saves a backward
all-gather), so it is compared on the step, forward plus backward step time,
within one all-tensor budget: the pipeline's step peak (the larger of its
forward and backward peaks) at each of the pipeline's three budgets.
``overlap-plan @dc``, ``@dc@B`` and ``@dc@ff`` rows in each graph's table are
its plans at those step budgets; per graph they are not comparable (a kept
parameter moves time and memory between the graphs), the step is.

The targets, per graph (orders), with their tolerance ``tol`` = 3% at 8 to 31
layers and 1% at 32 and more (n/a on the 2-layer samples, where only the fits
checks apply):

1. At B: gathered peak <= B, all-tensor peak <= fast-free's + (B - fast-free's
   gathered peak), step within ``tol`` of ``overlap`` unlimited.
2. At fast-free's gathered peak: step and all-tensor peak no higher than fast-free's.
3. Unlimited: step within 5% (8-31 layers) / 2% (32+) of the tight bound.
4. At fast-free's, simple-prefetch's and each prefetch-ahead(k)'s gathered
   peak: no slower than it; at B no slower than any prefetch-ahead(k) fitting B.
5. ``overlap --budget-scope all`` at each ``deepcompile order``'s all-tensor
   peak: fits, and no slower than that order by more than ``tol``.

Per step (plans):

6. ``overlap-plan`` at each ``deepcompile plan``'s step peak (scope all): both
   graphs' peaks fit, and its step (forward + backward) no slower than the
   pipeline's by more than ``tol``.

Everything is measured with dcsched's simulator. ``sched s`` is the CPU time
(``time.process_time``) of computing the order or plan (for ``overlap``: setup
plus one budget; for ``overlap-plan``: the step, shown on both graphs), so a
busy machine does not inflate it. Captured bundles are cached in
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

from dcsched.budget import Budget  # noqa: E402
from dcsched.errors import BudgetError  # noqa: E402
from dcsched.graph.form import GraphForm, paused_gc  # noqa: E402
from dcsched.graph.nxview import to_networkx  # noqa: E402
from dcsched.schedulers import run, run_step  # noqa: E402
from dcsched.schedulers.overlap.scheduler import UNLIMITED, Overlap  # noqa: E402
from dcsched.sim.bounds import budget_bound, tight_bound  # noqa: E402
from dcsched.sim.collectives import latency_from_provenance  # noqa: E402
from dcsched.sim.plans import simulate_plan  # noqa: E402
from dcsched.sim.simulate import CompiledGraph, compile_view  # noqa: E402
from dcsched.units import format_bytes  # noqa: E402

AHEAD = (1, 2, 4, 8)
BASELINES = ("none", "list", "simple-prefetch", "fast-free")
EPS = 1e-9
#: DeepCompile's pipeline at its three budgets (label suffixes): its order without buckets (``ORDERS``), its plan
#: with them (``PLANS``), and overlap-plan at that plan's step peak (``STEP_PLANS``).
PIPELINE_BUDGETS = ("", " @B", " @ff")
ORDERS = tuple(f"deepcompile order{s}" for s in PIPELINE_BUDGETS)
PLANS = tuple(f"deepcompile plan{s}" for s in PIPELINE_BUDGETS)
STEP_PLANS = tuple(f"overlap-plan @dc{s.strip()}" for s in PIPELINE_BUDGETS)
STEP_SCHEDULER = "overlap-plan"


def _tolerance(layers: int | None, at_32: float, at_8: float) -> float | None:
    if layers is None or layers < 8:
        return None
    return at_32 if layers >= 32 else at_8


@dataclasses.dataclass
class Runs:
    """One graph's orders and plans by every algorithm at its budgets, simulated: what the targets are checked on.

    ``compiled`` (the graph compiled with the bundle's collective latency) simulates plans with their
    buckets; ``scheduler.compiled`` orders (no buckets: the latency does not enter).
    """

    part: str
    form: GraphForm
    scheduler: Overlap
    compiled: CompiledGraph
    tight: float
    budget_b: float = 0.0
    bound_b: float = 0.0
    rows: list = dataclasses.field(default_factory=list)
    results: dict = dataclasses.field(default_factory=dict)
    #: DeepCompile order label -> (its step, overlap's at its all-tensor peak), as check_targets found them.
    vs_pipeline: dict = dataclasses.field(default_factory=dict)

    def add(self, label: str, order=None, seconds=None, budget=None, plan=None):
        """Simulate an order (node numbers or names), or a plan with its buckets and residency as
        ``dcsched schedule`` does (:func:`simulate_plan`)."""
        if plan is not None:
            result = simulate_plan(self.compiled, plan, self.part, detail=False)
        else:
            result = self.scheduler.compiled.simulate(order, detail=False)
        self.results[label] = result
        bounds = self.scheduler.compiled.bounds
        self.rows.append(dict(algo=label, peak=result.peak_bytes, gathered=result.gathered_peak_bytes,
                              step=result.step_ms, overlap=result.overlap_pct, collectives=result.collectives,
                              vs_simple=result.step_ms / bounds.simple, vs_tight=result.step_ms / self.tight,
                              seconds=seconds, budget=budget))
        return result


def _timed(func, *args, **kwargs):
    started = time.process_time()
    value = func(*args, **kwargs)
    return value, time.process_time() - started


def run_algorithms(name: str, part: str, graph, latency_ms: float) -> Runs:
    """Every baseline, DeepCompile's pipeline at three budgets (order and plan), prefetch-ahead(k) and
    overlap at B, ff and unlimited, on graph ``part`` of a step."""
    view = to_networkx(graph)
    form = GraphForm(view)
    started = time.process_time()
    with paused_gc():  # as the registered scheduler runs
        scheduler = Overlap(view, name=name)
    setup_s = time.process_time() - started
    runs = Runs(part, form, scheduler, compile_view(form, assume_zero=True, name=name, comm_latency_ms=latency_ms),
                tight_bound(scheduler.compiled))
    for algo in BASELINES:
        plan, seconds = _timed(run, algo, GraphForm(form))
        runs.add(algo, list(plan.order), seconds=seconds)
    ff = runs.results["fast-free"]
    runs.budget_b = budget_b = max(ff.gathered_peak_bytes, 2 * scheduler.largest_gather)
    # DeepCompile's pipeline: with DeepSpeed's budget (the device, unlimited for these graphs: only its
    # 4e9-byte buffer cap holds prefetches back), at fast-free's all-tensor peak plus what B adds over
    # fast-free's gathered peak, and at fast-free's all-tensor peak; its order alone, then its plan.
    pipeline_budgets = (math.inf, ff.peak_bytes + budget_b - ff.gathered_peak_bytes, ff.peak_bytes)
    plans = {}
    for order_label, plan_label, budget in zip(ORDERS, PLANS, pipeline_budgets):
        plan, seconds = _timed(run, "deepcompile", GraphForm(form), budget=Budget(budget, "all"))
        runs.add(order_label, list(plan.order), seconds=seconds, budget=None if math.isinf(budget) else budget)
        plans[plan_label] = (plan, seconds, budget)
    for plan_label, (plan, seconds, budget) in plans.items():
        runs.add(plan_label, plan=plan, seconds=seconds, budget=None if math.isinf(budget) else budget)
    for k in AHEAD:
        plan, seconds = _timed(run, "prefetch-ahead", GraphForm(form), k=k)
        runs.add(f"prefetch-ahead k={k}", list(plan.order), seconds=seconds)
    runs.bound_b = max(runs.tight, budget_bound(scheduler.compiled, budget_b))
    # overlap at several budgets from one setup (the registered scheduler sets up once per call).
    for label, budget in (("overlap @B", budget_b), ("overlap @ff", ff.gathered_peak_bytes),
                          ("overlap unlimited", UNLIMITED)):
        t = time.process_time()
        if budget >= scheduler.min_budget():
            with paused_gc():
                order, _ = scheduler.plan(budget)
            runs.add(label, order, seconds=time.process_time() - t + setup_s, budget=budget)
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
    # 5. At the all-tensor peak of DeepCompile's pipeline's order (scope all): within it, no slower than it.
    tol = _tolerance(layers, 0.01, 0.03)
    vs_pipeline = runs.vs_pipeline
    for other in ORDERS:
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


def compare_step(name: str, runs: dict[str, Runs], layers: int | None,
                 latency_ms: float) -> tuple[list[dict], list[tuple[str, str, str]]]:
    """Target 6 on one step: ``overlap-plan`` at each ``deepcompile plan``'s step peak against that plan.

    The pipeline plans each graph alone; the step's memory is the larger of its graphs' all-tensor peaks, the
    one budget ``overlap-plan`` (a step scheduler: kept parameters trade forward memory for backward
    all-gathers) gets for both graphs. Its plans are added to each graph's rows (``STEP_PLANS``).

    Returns
    -------
    rows : list of dict
        One per pipeline budget: the step budget, both plans' graph steps and peaks, the ratio of the steps.
    verdicts : list of (target, status, detail)
    """
    forms = {part: GraphForm(r.form) for part, r in runs.items()}
    tol = _tolerance(layers, 0.01, 0.03)
    rows, verdicts = [], []
    for theirs_label, mine_label in zip(PLANS, STEP_PLANS):
        theirs = {part: r.results[theirs_label] for part, r in runs.items()}
        budget = max(result.peak_bytes for result in theirs.values())
        target = (f"{STEP_SCHEDULER} at {theirs_label}'s step peak: fits"
                  + ("" if tol is None else f", step <= {theirs_label} + {tol:.0%}"))
        theirs_step = sum(result.step_ms for result in theirs.values())
        try:
            plans, seconds = _timed(run_step, STEP_SCHEDULER, forms, budget=Budget(budget, "all"),
                                    comm_latency_ms=latency_ms)
        except BudgetError as exc:
            verdicts.append((target, "FAIL", f"step peak {format_bytes(budget)}: {exc}"))
            rows.append(dict(graph=name, pipeline=theirs_label, budget=budget, theirs=theirs, mine=None))
            continue
        mine = {part: r.add(mine_label, plan=plans[part], seconds=seconds, budget=budget) for part, r in runs.items()}
        mine_step = sum(result.step_ms for result in mine.values())
        ratio = mine_step / theirs_step
        mine_peak = max(result.peak_bytes for result in mine.values())
        ok = mine_peak <= budget and (tol is None or ratio <= 1 + tol + EPS)
        verdicts.append((target, "PASS" if ok else "FAIL",
                         f"{mine_step:.3f} vs {theirs_step:.3f} ms ({ratio:.4f}x), peak {format_bytes(mine_peak)}"
                         f" <= {format_bytes(budget)}"))
        rows.append(dict(graph=name, pipeline=theirs_label, budget=budget, theirs=theirs, mine=mine, ratio=ratio,
                         verdict=verdicts[-1][1]))
    return rows, verdicts


def render(rows: list[dict], verdicts) -> str:
    head = rows[0]
    lines = [f"\n## {head['graph']}: {head['nodes']} nodes, {head['gathers']} all-gathers; lower bounds for "
             f"unbucketed orders: simple {head['simple']:.3f} ms, tight {head['tight']:.3f} ms (simulator's "
             f"{head['sim_tight']:.3f}); B = {format_bytes(head['budget_b'])}, overlap's minimum = "
             f"{format_bytes(head['min_budget'])}",
             f"| {'algorithm':22s} | {'peak':>11s} | {'gathered':>11s} | {'step ms':>9s} | {'overlap':>7s} "
             f"| {'coll':>5s} | {'/simple':>7s} | {'/tight':>7s} | {'sched s':>7s} |",
             "|" + "|".join("-" * w for w in (24, 13, 13, 11, 9, 7, 9, 9, 9)) + "|"]
    for r in rows[1:]:
        if r.get("infeasible"):
            lines.append(f"| {r['algo']:22s} | budget {format_bytes(r['budget'])} below overlap's minimum |")
            continue
        secs = "" if r["seconds"] is None else f"{r['seconds']:.3f}"
        lines.append(f"| {r['algo']:22s} | {format_bytes(r['peak']):>11s} | {format_bytes(r['gathered']):>11s} "
                     f"| {r['step']:9.3f} | {r['overlap']:6.1f}% | {r['collectives']:5d} | {r['vs_simple']:7.3f} "
                     f"| {r['vs_tight']:7.3f} | {secs:>7s} |")
    lines.append("(`coll`: collectives issued; /simple and /tight bound unbucketed orders: the plan rows, "
                 f"`deepcompile plan*` and `{STEP_SCHEDULER}*`, fuse collectives and can go under them)")
    lines.append("")
    for target, status, detail in verdicts:
        lines.append(f"- {status:4s} {target}: {detail}")
    return "\n".join(lines)


def render_step(name: str, verdicts) -> str:
    return "\n".join([f"\n### {name} step (forward + backward): plans"]
                     + [f"- {status:4s} {target}: {detail}" for target, status, detail in verdicts])


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


def print_order_tables(compact: list[dict]) -> None:
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
    print("\n## DeepCompile's pipeline's order (no buckets) against overlap (scope all) at the order's all-tensor "
          "peak, step ms\n")
    print("| graph | " + " | ".join(f"{p} | overlap at its peak | ratio" for p in ORDERS) + " |")
    print("|---|" + "---|---|---|" * len(ORDERS))
    for c in compact:
        cells = []
        for other in ORDERS:
            theirs, mine = c["vs_pipeline"].get(other, (math.nan, math.nan))
            cells.append(f"{theirs:.3f} | {mine:.3f} | {mine / theirs:.4f}")
        print(f"| {c['graph']} | " + " | ".join(cells) + " |")


def print_plan_table(step_rows: list[dict]) -> None:
    print(f"\n## DeepCompile's plan (fused groups as buckets) against {STEP_SCHEDULER} at the plan's step peak "
          "(all tensors), step ms (forward + backward)\n")
    print(f"| step | pipeline | step peak | deepcompile fwd + bwd | {STEP_SCHEDULER} fwd + bwd | ratio "
          f"| {STEP_SCHEDULER} peak | target |")
    print("|---|---|---|---|---|---|---|---|")
    for r in step_rows:
        theirs = r["theirs"]
        cell = " + ".join(f"{result.step_ms:.3f}" for result in theirs.values())
        total = sum(result.step_ms for result in theirs.values())
        if r["mine"] is None:
            print(f"| {r['graph']} | {r['pipeline']} | {format_bytes(r['budget'])} | {cell} = {total:.3f} "
                  "| does not fit | | | FAIL |")
            continue
        mine = r["mine"]
        mine_cell = " + ".join(f"{result.step_ms:.3f}" for result in mine.values())
        mine_total = sum(result.step_ms for result in mine.values())
        peak = max(result.peak_bytes for result in mine.values())
        print(f"| {r['graph']} | {r['pipeline']} | {format_bytes(r['budget'])} | {cell} = {total:.3f} "
              f"| {mine_cell} = {mine_total:.3f} | {r['ratio']:.4f} | {format_bytes(peak)} | {r['verdict']} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graphs", nargs="*", help="sample:<name> or <arch>-<layers> (default: all)")
    parser.add_argument("--quick", action="store_true", help="samples and each architecture's shallowest stack only")
    parser.add_argument("--stress", action="store_true", help="also the stress configurations (quality_graphs.STRESS)")
    args = parser.parse_args(argv)
    totals: dict[str, int] = {}
    failures = []
    compact, step_rows = [], []

    def tally(label: str, verdicts) -> None:
        for target, status, detail in verdicts:
            totals[status] = totals.get(status, 0) + 1
            if status in ("FAIL", "OUT OF REACH"):
                failures.append(f"{status} {label}: {target} ({detail})")
    for name, bundle, layers in graphs(args.graphs, args.quick, args.stress):
        latency_ms = latency_from_provenance(bundle.provenance)
        runs = {part: run_algorithms(f"{name} {part}", part, graph, latency_ms)
                for part, graph in bundle.graphs.items()}
        order_verdicts = {part: check_targets(r, layers) for part, r in runs.items()}
        rows, step_verdicts = compare_step(name, runs, layers, latency_ms)
        step_rows += rows
        for part, r in runs.items():
            label = f"{name} {part}"
            head = summary(label, r, order_verdicts[part])
            compact.append(head["compact"])
            print(render([head] + r.rows, order_verdicts[part]), flush=True)
            tally(label, order_verdicts[part])
        print(render_step(name, step_verdicts), flush=True)
        tally(f"{name} step", step_verdicts)
    print_order_tables(compact)
    print_plan_table(step_rows)
    print("\n## Summary: " + ", ".join(f"{k} {v}" for k, v in sorted(totals.items())))
    for line in failures:
        print(f"- {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
