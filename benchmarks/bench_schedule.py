"""Speed of dcsched's schedulers against DeepSpeed 0.19.8's, on layered graphs of growing size.

Run with dcsched's venv for dcsched's figures alone, or with a Python that
also has deepspeed==0.19.8 (e.g. ``/work/dsvenv/bin/python``) for the
reference figures side by side::

    python benchmarks/bench_schedule.py                 # up to ~100,000 nodes
    python benchmarks/bench_schedule.py --max-nodes 20000 --timeout 30
    python benchmarks/bench_schedule.py --algos overlap --budget-factor 1.1   # a finite budget

Graphs: :func:`dcsched.synthetic.layered_stack` forward and backward graphs
(transformer-like layers of 16 parameters; ``untied``: a separate LM head as
in Llama; ``tied``: the GPT-2 style head that shares the embedding weight),
up to 1,100 layers (about 100,000 forward and 114,000 backward nodes) in both
series; ``captured``: chained copies of the captured sample Llama
(``sample_graphs/llama.pt``, real ops, sizes and profiled times; see
:mod:`dcsched.synthetic.stacking`), up to 120 copies (57,601 forward and 100,511
backward nodes).
Per algorithm, one row per graph: nodes, all-gathers, dcsched seconds for the
order alone (``dcsched.schedulers.run`` on the graph form built from the networkx view) and for the whole
``dcsched.schedule`` call (graph form or view, order, rebuilt FX graph; best of ``--repeat`` in a
fresh (spawned) process that builds the graph, as the CLI runs it), that
process's peak resident memory over the first call (``peak RSS MiB``, the graph
included) and how much the call added to what it held before the call
(``+RSS MiB``, from the peak reset at the call's start), DeepSpeed's seconds (run in a child process and stopped at
``--timeout``; graphs at least as large as one it timed out on are skipped;
'n/a' without DeepSpeed), their ratio, and per series the growth exponent k of t ~ N^k
fitted over the graphs of at least 1,000 nodes. Last, memory against size: per
algorithm and series, what the call added (+RSS) per 1,000 nodes at each size and
the growth exponent of +RSS fitted over the graphs of at least 10,000 nodes (1:
linear).

``--cli`` measures the command line instead, as a user runs it: it writes
bundles of ``--cli-sizes`` nodes (layered stacks, forward and backward
together; ``--v1``: also as version-1 torch files) and times, each in a fresh
process, ``dcsched.load`` (seconds inside the process, imports excluded),
``dcsched show --json``, ``dcsched schedule --algo fast-free`` and ``--algo
overlap`` (the bundle's default budget: 90% of 141 GB), end to end with the
interpreter's start, with the peak RSS of the largest of the three commands::

    python benchmarks/bench_schedule.py --cli                       # 10^4, 10^5, 10^6 nodes
    python benchmarks/bench_schedule.py --cli --cli-sizes 10000,100000 --v1
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import sys
import time
import resource
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dcsched  # noqa: E402
from dcsched.graph.nxview import to_networkx  # noqa: E402
from dcsched.budget import Budget  # noqa: E402
from dcsched.graph.form import GraphForm  # noqa: E402
from dcsched.schedulers import run  # noqa: E402
from dcsched.schedulers.overlap.scheduler import Overlap  # noqa: E402
from dcsched.synthetic.stacking import stack_copies  # noqa: E402
from dcsched.synthetic import GraphPair, layered_stack  # noqa: E402

LAYERS = (1, 3, 10, 30, 110, 330, 1100)
#: Copies of the captured sample Llama (forward 480, backward 908 nodes) in the ``captured`` series.
CAPTURED_COPIES = (1, 3, 11, 33, 120)
CAPTURED = ROOT / "sample_graphs" / "llama.pt"
DS_FUNCS = {"fast-free": "fast_free_schedule", "simple-prefetch": "simple_prefetch"}
#: Options per algorithm (overlap needs a budget: unlimited here).
OPTIONS = {"overlap": {"memory_budget": math.inf}}


def _status_mib(field: str) -> float | None:
    """``VmRSS`` / ``VmHWM`` of this process from /proc (Linux), in MiB; None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Set the peak resident memory (VmHWM) back to the current one (Linux 4.0+); whether it could."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _run_whole_call(spec, algo, options, repeat, conn) -> None:
    series, n_layers, kind = spec
    pair = captured_stack(n_layers) if series == "captured" else layered_stack(n_layers, tied=series == "tied")
    graph = getattr(pair, kind)
    del pair
    before = _status_mib("VmRSS")
    if before is None or not _reset_peak_rss():  # no /proc: the peak since the start, graph building included
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    seconds, _ = timed(lambda: dcsched.schedule(graph, algo, **options))
    after = _status_mib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if repeat > 1:
        seconds = min(seconds, timed(lambda: dcsched.schedule(graph, algo, **options), repeat=repeat - 1)[0])
    conn.send((seconds, after, after - before))


def fresh_whole_call(spec: tuple[str, int, str], algo: str, options: dict,
                     repeat: int) -> tuple[float, float, float] | None:
    """The whole ``dcsched.schedule`` call with ``options`` on the graph ``spec`` = (series, layers or copies,
    'forward'/'backward'), in a fresh (spawned) process that builds the graph and runs it ``repeat`` times:
    (least seconds, peak RSS MiB, MiB the first call added to it). Fresh, as the CLI runs it: a process
    that has built and dropped earlier 10^5-node graphs allocates more slowly (0.5 s more per call seen
    here), and a forked child starts with the parent's freed-but-resident heap and fills that first,
    undercounting what the call adds."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_run_whole_call, args=(spec, algo, options, repeat, child))
    proc.start()
    measured = parent.recv() if parent.poll(600) else None
    proc.join()
    return measured


def overlap_options(view, budget_factor: float | None) -> dict:
    """overlap's options: unlimited, or ``budget_factor`` times the smallest budget over all tensors it can
    meet on ``view`` (the default scope; found before, and outside, the timed calls)."""
    if budget_factor is None:
        return OPTIONS["overlap"]
    return {"memory_budget": math.floor(budget_factor * Overlap(view).min_budget("all"))}


def captured_stack(copies: int) -> GraphPair:
    """The sample Llama bundle's graphs, each as ``copies`` chained copies
    (:func:`dcsched.synthetic.stacking.stack_copies`)."""
    bundle = dcsched.load(CAPTURED)
    return GraphPair(stack_copies(bundle.forward, copies), stack_copies(bundle.backward, copies))


def deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
        return deepspeed.__version__ == "0.19.8"
    except Exception:
        return False


def _run_reference(graph, algo, conn) -> None:
    from dcsched.deepspeed import reference_list_schedule, to_deepspeed_graph

    list_schedule, _ = reference_list_schedule()
    ds_graph = to_deepspeed_graph(graph)
    start = time.perf_counter()
    getattr(list_schedule, DS_FUNCS[algo])(ds_graph, 0, 0, False)
    conn.send(time.perf_counter() - start)


def reference_seconds(graph, algo: str, timeout: float) -> float | None:
    """DeepSpeed's time in a forked child; None if it ran past ``timeout`` or failed."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_run_reference, args=(graph, algo, child))
    proc.start()
    result = parent.recv() if parent.poll(timeout + 15) else None  # + time to set DeepSpeed up
    if proc.is_alive():
        proc.terminate()
    proc.join()
    return result if result is not None and result <= timeout else None


def fit_exponent(points: list[tuple[int, float]], min_nodes: int = 1000) -> float | None:
    points = [(n, t) for n, t in points if n >= min_nodes and t and t > 0]
    if len(points) < 2:
        return None
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else None


def timed(func, *args, repeat: int = 1):
    """Least wall time of ``repeat`` calls, and the last result."""
    best = math.inf
    result = None
    for _ in range(repeat):
        start = time.perf_counter()
        result = func(*args)
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-nodes", type=int, default=120_000, help="largest graph (nodes)")
    parser.add_argument("--min-nodes", type=int, default=0, help="smallest graph measured (nodes)")
    parser.add_argument("--repeat", type=int, default=2, help="whole-call runs per graph (the least time is shown)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds allowed to DeepSpeed per run")
    parser.add_argument("--series", default="untied,tied,captured", help="comma-separated: untied, tied, captured")
    parser.add_argument("--algos", default="fast-free,simple-prefetch,list,overlap")
    parser.add_argument("--budget-factor", type=float, default=None,
                        help="run overlap at this multiple of its smallest all-tensor budget on each graph "
                             "(default: unlimited)")
    parser.add_argument("--tied-max-nodes", type=int, default=None,
                        help="largest tied-head graph (default: --max-nodes)")
    parser.add_argument("--cli", action="store_true",
                        help="instead: the command line end to end on bundles of --cli-sizes nodes (show, "
                             "schedule --algo fast-free, schedule --algo overlap, each in a fresh process)")
    parser.add_argument("--cli-sizes", default="10000,100000,1000000",
                        help="with --cli: total nodes (forward + backward) of each bundle")
    parser.add_argument("--v1", action="store_true",
                        help="with --cli: also time version-1 bundles (torch files), for comparison")
    parser.add_argument("--v1-max-nodes", type=int, default=200_000,
                        help="with --cli --v1: the largest version-1 bundle (they load slowly: 10 minutes at 10^6)")
    parser.add_argument("--workdir", default=None, help="with --cli: where bundles go and stay, reused by the next "
                                                         "run (default: a temporary directory, removed after)")
    args = parser.parse_args()
    if args.cli:
        cli_series(args)
        return
    algos = args.algos.split(",")
    with_reference = deepspeed_available()
    print(f"dcsched {dcsched.__version__}; reference: "
          f"{'DeepSpeed 0.19.8' if with_reference else 'n/a (deepspeed 0.19.8 not importable)'}; "
          f"timeout {args.timeout:.0f} s; overlap's budget: "
          + ("unlimited" if args.budget_factor is None else f"{args.budget_factor:g} x its smallest over all tensors"))

    started = time.time()
    rows = measure(args, algos, with_reference)
    print_tables(rows, algos, args, with_reference)
    print_memory_growth(rows, algos, args.series.split(","))
    print(f"\ntotal benchmark time {time.time() - started:.0f} s")


# ---------------------------------------------------------------------------
# --cli: the command line end to end
# ---------------------------------------------------------------------------

#: Nodes per layer of :func:`layered_stack`, forward and backward together (about 91 + 104).
NODES_PER_LAYER = 195
#: What the bundles record as the target device's memory (overlap's default budget is 90% of it): an
#: H200's 141 GB, as the 10^6-node stack needs 72.4 GB at least (all tensors).
DEVICE_BYTES = 141 * 10**9

_LOAD = ("import sys, time; from dcsched.bundle.core import load; t = time.perf_counter(); b = load(sys.argv[1]); "
         "[b.form(name) for name in b.graph_names] if sys.argv[2] == 'form' else None; "
         "print(time.perf_counter() - t)")


def stack_params(pair: GraphPair) -> list:
    """The parameter table of a synthetic stack: one float32 vector per ds_id its all-gathers name, of the
    gathered bytes (a loader refuses an op naming no parameter of the table)."""
    import torch
    from dcsched.bundle.core import ParamInfo
    from dcsched.graph.roles import Role, ds_id_of, role_of
    sizes = {ds_id_of(node): int(node.meta.get("tensor_size") or 4) for graph in (pair.forward, pair.backward)
             for node in graph.nodes if role_of(node) is Role.ALLGATHER}
    sizes.update({ds_id_of(node): sizes.get(ds_id_of(node), 4) for graph in (pair.forward, pair.backward)
                  for node in graph.nodes if role_of(node) is Role.REDUCE})
    return [ParamInfo(f"p{d}", (max(size // 4, 1),), torch.float32, d) for d, size in sorted(sizes.items())]


def cli_bundle(nodes: int, path: Path, *, v1: bool) -> int:
    """Write a bundle of about ``nodes`` nodes (layered stack, forward and backward); its node count."""
    import gc
    import torch
    from dcsched.bundle.core import Bundle, save, to_data
    pair = layered_stack(max(1, round(nodes / NODES_PER_LAYER)))
    bundle = Bundle(forward=pair.forward, backward=pair.backward, params=stack_params(pair), inputs=[],
                    forward_placeholders=[], backward_placeholders=[],
                    provenance={"target_memory_bytes": DEVICE_BYTES, "gpu": "synthetic"})
    if v1:  # version 1: the plain-data torch file dcsched still reads
        torch.save(to_data(bundle), path)
    else:
        save(bundle, path)
    count = len(pair.forward.nodes) + len(pair.backward.nodes)
    del pair, bundle
    gc.collect()
    return count


def fresh(argv: list[str]) -> tuple[float, float, str]:
    """(seconds, peak RSS MiB, stdout) of ``argv`` run in a fresh process."""
    import os
    import subprocess
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    import tempfile
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: its peak RSS
        seconds = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {err.read().strip()[-500:]}")
        return seconds, usage.ru_maxrss / 1024, out.read()


def cli_series(args) -> None:
    """Time ``dcsched show``, ``schedule --algo fast-free`` and ``schedule --algo overlap`` end to end."""
    import shutil
    import tempfile
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dcsched-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "dcsched"]
    from dcsched.bundle.core import BUNDLE_VERSION  # what save writes (3 since plans are stored)
    versions = (BUNDLE_VERSION, 1) if args.v1 else (BUNDLE_VERSION,)
    rows = []
    try:
        for nodes in (int(n) for n in args.cli_sizes.split(",")):
            for version in versions:
                if version == 1 and nodes > args.v1_max_nodes:
                    continue
                path = workdir / f"stack{nodes}.v{version}.pt"
                started = time.perf_counter()
                if args.workdir and path.exists():  # kept from an earlier run
                    import dcsched as _d
                    count = sum(len(_d.load(path).form(name)) for name in ("forward", "backward"))
                else:
                    count = cli_bundle(nodes, path, v1=version == 1)
                made = time.perf_counter() - started
                row = {"nodes": count, "version": version, "MB": path.stat().st_size / 1e6, "write_s": made}
                load_s, _, out = fresh([sys.executable, "-c", _LOAD, str(path), "load"])
                row["load_s"] = float(out.strip().splitlines()[-1])
                row["show_s"], peak_show, _ = fresh([*cli, "show", str(path), "--json"])
                row["fast_free_s"], peak_ff, _ = fresh([*cli, "schedule", str(path), "--algo", "fast-free", "--json",
                                                        "-o", str(workdir / "out.pt"), "--force"])
                row["overlap_s"], peak_ov, _ = fresh([*cli, "schedule", str(path), "--algo", "overlap", "--json",
                                                      "-o", str(workdir / "out.pt"), "--force"])
                row["peak_mib"] = max(peak_show, peak_ff, peak_ov)
                rows.append(row)
                print(f"{count:>9,} nodes v{version}: {row['MB']:.1f} MB written in {made:.1f} s; load "
                      f"{row['load_s']:.2f} s, show {row['show_s']:.2f} s, fast-free {row['fast_free_s']:.2f} s, "
                      f"overlap {row['overlap_s']:.2f} s, peak RSS {row['peak_mib']:.0f} MiB", flush=True)
                if not args.workdir:
                    path.unlink()
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print("\n| nodes | bundle | file MB | load s | show s | schedule fast-free s | schedule overlap s | "
          "peak RSS MiB |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['nodes']:,} | v{r['version']} | {r['MB']:.1f} | {r['load_s']:.2f} | {r['show_s']:.2f} | "
              f"{r['fast_free_s']:.2f} | {r['overlap_s']:.2f} | {r['peak_mib']:.0f} |")
    v2 = [r for r in rows if r["version"] != 1 and r["nodes"] >= 10_000]
    if len(v2) >= 2:
        k = math.log(v2[-1]["peak_mib"] / v2[0]["peak_mib"]) / math.log(v2[-1]["nodes"] / v2[0]["nodes"])
        print(f"\npeak RSS growth exponent (safetensors, {v2[0]['nodes']:,} to {v2[-1]['nodes']:,} nodes): {k:.2f}")


def measure(args, algos: list[str], with_reference: bool) -> dict[str, list]:
    """Per algorithm, one row per graph of the asked series and sizes: (series, graph name, nodes,
    all-gathers, order seconds, whole-call seconds, (peak RSS, +RSS) MiB or None, reference seconds
    or None)."""
    rows: dict[str, list] = {a: [] for a in algos}
    reference_gave_up_at = {a: math.inf for a in algos}  # DeepSpeed timed out at this many nodes
    for series in args.series.split(","):
        limit = args.max_nodes if series == "untied" or args.tied_max_nodes is None \
            else min(args.max_nodes, args.tied_max_nodes)
        for n_layers in (CAPTURED_COPIES if series == "captured" else LAYERS):
            pair = captured_stack(n_layers) if series == "captured" else layered_stack(n_layers, tied=series == "tied")
            if min(len(pair.forward.nodes), len(pair.backward.nodes)) > limit:
                break
            for kind in ("forward", "backward"):
                graph = getattr(pair, kind)
                n = len(graph.nodes)
                if n > limit or n < args.min_nodes:
                    continue
                view = to_networkx(graph)
                n_ags = sum(1 for _, d in view.nodes(data=True) if d["role"] == "allgather")
                for algo in algos:
                    # Best of a few runs: the machine may be shared, and the least time is the
                    # least disturbed one.
                    repeat = 3 if n < 20_000 else 2
                    options = overlap_options(view, args.budget_factor) if algo == "overlap" \
                        else OPTIONS.get(algo, {})
                    own = {k: v for k, v in options.items() if k != "memory_budget"}
                    budget = Budget.parse(options["memory_budget"]) if "memory_budget" in options else None
                    def order(algo=algo, view=view, budget=budget, own=own):  # the graph form built inside
                        return run(algo, GraphForm(view), budget=budget, **own)
                    order_s, _ = timed(order, repeat=repeat)
                    measured = fresh_whole_call((series, n_layers, kind), algo, options, args.repeat)
                    whole_s, rss = (math.nan, None) if measured is None else (measured[0], measured[1:])
                    ref = None
                    if with_reference and algo in DS_FUNCS and n < reference_gave_up_at[algo]:
                        ref = reference_seconds(graph, algo, args.timeout)
                        if ref is None:
                            reference_gave_up_at[algo] = n
                    rows[algo].append((series, f"{series} {kind} x{n_layers}", n, n_ags, order_s, whole_s, rss, ref))
                    print(f"  ... {algo:15s} {series} {kind:8s} {n:7d} nodes: {order_s:.3f} s"
                          + (f", DeepSpeed {ref:.2f} s" if ref else ""), flush=True)
    return rows


def print_tables(rows: dict[str, list], algos: list[str], args, with_reference: bool) -> None:
    """One table per algorithm, then the growth exponent of the order time per series."""
    for algo in algos:
        print()
        print(f"{algo}")
        header = f"{'graph':24s} {'N':>8s} {'all-gathers':>11s} {'order s':>9s} {'whole s':>9s} " \
                 f"{'peak RSS MiB':>12s} {'+RSS MiB':>8s} {'reference s':>12s} {'ratio':>9s}"
        print(header)
        print("-" * len(header))
        for _series, name, n, n_ags, order_s, whole_s, rss, ref in rows[algo]:
            if algo not in DS_FUNCS:  # DeepSpeed's list_schedule fails on every graph; overlap is dcsched's own
                ref_text, ratio = "n/a (broken)" if algo == "list" else "n/a", ""
            elif ref is None:
                ref_text, ratio = ("n/a" if not with_reference else f">{args.timeout:.0f}"), ""
            else:
                ref_text, ratio = f"{ref:.3f}", f"{ref / order_s:.0f}x"
            peak_text, added_text = ("n/a", "n/a") if rss is None else (f"{rss[0]:.0f}", f"{rss[1]:.0f}")
            print(f"{name:24s} {n:8d} {n_ags:11d} {order_s:9.3f} {whole_s:9.3f} {peak_text:>12s} {added_text:>8s} "
                  f"{ref_text:>12s} {ratio:>9s}")
        for series in args.series.split(","):
            for kind in ("forward", "backward"):
                pts = [(n, o) for s, name, n, _, o, _, _, _ in rows[algo] if s == series and kind in name]
                ref_pts = [(n, r) for s, name, n, _, _, _, _, r in rows[algo] if s == series and kind in name and r]
                k, kr = fit_exponent(pts), fit_exponent(ref_pts)
                if k is not None:
                    print(f"growth exponent ({series} {kind}): dcsched N^{k:.2f}"
                          + (f", reference N^{kr:.2f}" if kr is not None else ""))


def print_memory_growth(rows: dict[str, list], algos: list[str], series_names: list[str]) -> None:
    """Memory against size: +RSS per 1,000 nodes at each size, and the growth exponent of +RSS."""
    print("\nmemory vs size (+RSS MiB per 1,000 nodes at each size; growth exponent k of +RSS ~ N^k, N >= 10,000)")
    for algo in algos:
        for series in series_names:
            for kind in ("forward", "backward"):
                pts = [(n, rss[1]) for s, name, n, _, _, _, rss, _ in rows[algo]
                       if s == series and kind in name and rss is not None]
                if not pts:
                    continue
                k = fit_exponent(pts, min_nodes=10_000)
                cells = ", ".join(f"{n:,}: {added / n * 1000:.2f}" for n, added in pts if n >= 1000)
                print(f"  {algo} {series} {kind}: {cells or 'no graph of 1,000+ nodes'}"
                      + (f"; k = {k:.2f}" if k is not None else ""))


if __name__ == "__main__":
    main()
