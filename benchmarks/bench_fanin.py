"""Every scheduler on wide fan-ins: one node reading N gathered parameters, then a chain of N releases.

:func:`dcsched.synthetic.fanin.fanin_graph` at each ``--params`` size (forward,
and backward with ``--backward``): one ``aten.cat`` reading every parameter's
wait, then the release chain (4N + 3 nodes forward), parameter sizes of three
values (so same-size all-gathers tie, as experts do) or, with
``--distinct-sizes``, all different. Per graph and algorithm, one row: nodes,
dcsched's seconds for ``dcsched.schedulers.run`` on the graph form (each run in
a fresh spawned process, stopped at ``--timeout``; wall and CPU seconds: on a
shared machine the CPU seconds are the steadier figure), and DeepSpeed's seconds
and the ratio where ``deepspeed`` is importable ('n/a' otherwise: DeepSpeed's
``fast_free_schedule`` and ``simple_prefetch`` are the only references, run on
the same graph in the ``dc`` namespace)::

    python benchmarks/bench_fanin.py                         # 2,000 and 8,000 parameters
    python benchmarks/bench_fanin.py --params 500,1000 --algos fast-free,overlap --timeout 60
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: DeepSpeed 0.19.8's functions that dcsched's algorithms restate exactly.
DS_FUNCS = {"fast-free": "fast_free_schedule", "simple-prefetch": "simple_prefetch"}


def _schedule(n_params: int, kind: str, distinct: bool, algo: str, conn) -> None:
    from dcsched.graph.form import GraphForm
    from dcsched.schedulers import run
    from dcsched.synthetic.fanin import fanin_graph

    form = GraphForm(fanin_graph(n_params, kind=kind, distinct_sizes=distinct))
    start, cpu = time.perf_counter(), time.process_time()
    run(algo, form)
    conn.send((len(form), time.perf_counter() - start, time.process_time() - cpu))


def _reference(n_params: int, kind: str, distinct: bool, algo: str, conn) -> None:
    from dcsched.synthetic.fanin import fanin_graph

    graph = fanin_graph(n_params, kind=kind, distinct_sizes=distinct, namespace="dc")
    from deepspeed.compile import list_schedule  # type: ignore[import-not-found]

    func = getattr(list_schedule, DS_FUNCS[algo])
    start, cpu = time.perf_counter(), time.process_time()
    func(graph, 10**30, 0, False)
    conn.send((len(graph.nodes), time.perf_counter() - start, time.process_time() - cpu))


def fresh(target, args, timeout: float) -> tuple[int, float, float] | None:
    """``target(*args, conn)`` in a spawned process: what it sends, or None past ``timeout`` seconds."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, child))
    proc.start()
    result = parent.recv() if parent.poll(timeout) else None
    if result is None:
        proc.kill()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="2000,8000", help="comma-separated parameter counts")
    parser.add_argument("--algos", default=None, help="comma-separated (default: every registered one)")
    parser.add_argument("--backward", action="store_true", help="also the backward graphs (reduce_grad)")
    parser.add_argument("--distinct-sizes", action="store_true", help="every parameter of its own size")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds allowed per run")
    args = parser.parse_args()
    from dcsched.schedulers import available

    algos = args.algos.split(",") if args.algos else available()
    has_ds = importlib.util.find_spec("deepspeed") is not None
    kinds = ("forward", "backward") if args.backward else ("forward",)
    print(f"{'graph':<22} {'nodes':>7} {'algorithm':<16} {'seconds':>9} {'CPU s':>8} {'DeepSpeed s':>12} "
          f"{'ratio':>7}")
    for n_params in (int(p) for p in args.params.split(",")):
        for kind in kinds:
            label = f"fanin-{n_params}-{kind[:3]}" + ("-distinct" if args.distinct_sizes else "")
            for algo in algos:
                ours = fresh(_schedule, (n_params, kind, args.distinct_sizes, algo), args.timeout)
                ref = None
                if has_ds and algo in DS_FUNCS:
                    ref = fresh(_reference, (n_params, kind, args.distinct_sizes, algo), args.timeout)
                nodes = str(ours[0]) if ours else "?"
                mine = f"{ours[1]:.2f}" if ours else f">{args.timeout:.0f}"
                cpu = f"{ours[2]:.2f}" if ours else "-"
                theirs = f"{ref[1]:.2f}" if ref else ("n/a" if not has_ds or algo not in DS_FUNCS
                                                       else f">{args.timeout:.0f}")
                ratio = f"{ref[1] / ours[1]:.0f}x" if ours and ref and ours[1] > 0 else "n/a"
                print(f"{label:<22} {nodes:>7} {algo:<16} {mine:>9} {cpu:>8} {theirs:>12} {ratio:>7}", flush=True)
    if not has_ds:
        print("DeepSpeed is not importable here: no reference seconds.")


if __name__ == "__main__":
    main()
