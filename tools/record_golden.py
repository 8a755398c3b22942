"""Record DeepSpeed 0.19.8's scheduler orders as golden data for dcsched's differential tests.

Two steps, two interpreters:

1. ``.venv/bin/python tools/record_golden.py bundles`` captures small models of
   several architectures (dcsched/examples.py), profiles them with the analytic
   cost model and saves them as bundles under ``tests/golden/bundles/``, with
   copies of the repository's ``sample_graphs/*.pt`` (so the tests never
   re-capture and the golden inputs cannot drift).
2. ``/work/dsvenv/bin/python tools/record_golden.py record`` runs DeepSpeed
   0.19.8's ``fast_free_schedule`` and ``simple_prefetch`` (no budget) and its
   ``get_last_uses`` on every corpus graph and writes ``tests/golden/orders.json``.
3. ``/work/dsvenv/bin/python tools/record_golden.py prefetch`` runs DeepSpeed
   0.19.8's ``schedule_prefetch`` pass (``passes/prefetch.py``) over its own
   fast-free order of every corpus graph, at several memory budgets, and
   writes ``tests/golden/prefetch.json`` (see :func:`record_prefetch`).

The corpus: seeded random ZeRO-3-like DAGs (forward and backward style, small
to a few hundred nodes), layered transformer-like stacks, and the forward and
backward graphs of the bundles of step 1. For DeepSpeed, the graphs' ZeRO-3
ops are switched to stand-in ``torch.ops.dc.*`` ops (dcsched's kernels under
DeepSpeed's schemas), missing costs are set to 0 (dcsched reads them as 0),
``deepspeed.compile.util.dc_handle`` is set to a dummy so DeepSpeed builds no
extension, and the recursion limit is raised (DeepSpeed's DFS is recursive).

Each entry stores where the graph comes from, a digest of the graph
(:func:`dcsched.synthetic.graph_digest`), DeepSpeed's last uses as
``[value, user]`` input positions and, per scheduler, DeepSpeed's order as
input positions, or the error DeepSpeed raised, and whether the order is a
valid topological order of the graph (args and kwargs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GOLDEN = ROOT / "tests" / "golden"
BUNDLES = GOLDEN / "bundles"
ORDERS = GOLDEN / "orders.json"

#: (file stem, model, config) for step 1: small but real architectures.
CAPTURED = (
    ("gpt2l", "gpt", dict(n_layers=2, d_model=32, vocab=64, seq=8, batch=2)),
    ("llama2l", "llama", dict(n_layers=2)),
    ("convnet2l", "convnet", dict(n_layers=2)),
)


#: The repository's sample bundles (sample_graphs/<name>.pt), copied to
#: tests/golden/bundles/sample_<name>.pt by step 1 so the golden data cannot drift.
SAMPLES = ("convnet", "gpt", "llama")


def corpus() -> list[dict]:
    """The golden corpus, as source descriptions (see :func:`build`)."""
    entries = []
    for seed in range(120):
        for kind in ("forward", "backward"):
            entries.append({"source": "random", "seed": seed, "kind": kind})
    for seed in range(1000, 1016):
        for kind in ("forward", "backward"):
            entries.append({"source": "random", "seed": seed, "kind": kind, "n_params": 12 + seed % 20,
                            "n_ops": 60 + 5 * (seed % 16)})
    for seed in range(2000, 2004):
        # kwargs-only dependencies: DeepSpeed misses them; recorded to show it.
        entries.append({"source": "random", "seed": seed, "kind": "forward", "kwargs_deps": True})
    for n_layers in (1, 2, 4):
        for kind in ("forward", "backward"):
            entries.append({"source": "layered", "n_layers": n_layers, "kind": kind})
    for stem in [stem for stem, _, _ in CAPTURED] + [f"sample_{name}" for name in SAMPLES]:
        for kind in ("forward", "backward"):
            entries.append({"source": "bundle", "file": f"bundles/{stem}.pt", "kind": kind})
    return entries


def build(entry: dict):
    """The FX graph an entry describes (dcsched's op namespace)."""
    from dcsched.bundle import core as bundle
    from dcsched.synthetic import layered_stack, random_graph

    if entry["source"] == "random":
        return random_graph(entry["seed"], kind=entry["kind"], n_params=entry.get("n_params"),
                            n_ops=entry.get("n_ops"), kwargs_deps=entry.get("kwargs_deps", False))
    if entry["source"] == "layered":
        return getattr(layered_stack(entry["n_layers"]), entry["kind"])
    if entry["source"] == "bundle":
        return getattr(bundle.load(GOLDEN / entry["file"]), entry["kind"])
    raise ValueError(f"unknown source {entry['source']!r}")


def entry_id(entry: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in entry.items())


def make_bundles() -> None:
    import dcsched
    from dcsched.profile.capture import capture
    from dcsched.costmodels.options import ProfileOptions
    from dcsched.profile.measure import profile_bundle
    from dcsched.examples import build as build_model

    BUNDLES.mkdir(parents=True, exist_ok=True)
    for stem, name, config in CAPTURED:
        model, inputs, loss_fn = build_model(name, **config)
        captured = capture(model, inputs, loss_fn=loss_fn)
        # The figures the golden bundles were recorded with (before the interconnect table): re-recording must
        # give the same costs.
        profiled = profile_bundle(captured, ProfileOptions(cost_model="analytic", gpu="h100", latency_us=20.0,
                                                           bandwidth_gbps=100.0, progress=False))
        path = BUNDLES / f"{stem}.pt"
        dcsched.save(profiled, path)
        print(f"{path.relative_to(ROOT)}: {len(profiled.forward.nodes)} forward, "
              f"{len(profiled.backward.nodes)} backward nodes, {path.stat().st_size} bytes")
    for name in SAMPLES:
        source = ROOT / "sample_graphs" / f"{name}.pt"
        dcsched.save(dcsched.load(source), BUNDLES / f"sample_{name}.pt")
        print(f"{source.relative_to(ROOT)} -> tests/golden/bundles/sample_{name}.pt")


# ---------------------------------------------------------------------------
# Running DeepSpeed 0.19.8
# ---------------------------------------------------------------------------

def record() -> None:
    from dcsched.graph.nxview import check_order, to_networkx
    from dcsched.errors import GraphError
    from dcsched.synthetic import graph_digest

    from dcsched.deepspeed import reference_list_schedule, to_deepspeed_graph

    try:
        list_schedule, ds_util = reference_list_schedule()
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    import deepspeed

    results = []
    started = time.time()
    for entry in corpus():
        graph = build(entry)
        view = to_networkx(graph)
        record = {"id": entry_id(entry), "graph": entry, "digest": graph_digest(graph),
                  "nodes": len(graph.nodes)}
        node_to_last_use, _ = ds_util.get_last_uses(to_deepspeed_graph(graph))
        position = {name: i for i, name in enumerate(n.name for n in graph.nodes)}
        record["last_uses"] = sorted([position[n.name], position[u.name]] for n, u in node_to_last_use.items())
        for algo, func in (("fast-free", list_schedule.fast_free_schedule),
                           ("simple-prefetch", list_schedule.simple_prefetch)):
            t0 = time.perf_counter()
            try:
                out = func(to_deepspeed_graph(graph), 0, 0, False)
                order = [n.name for n in out.nodes]
            except Exception as exc:  # DeepSpeed fails on some graphs: record how
                record[algo] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                continue
            seconds = time.perf_counter() - t0
            try:
                check_order(view, order)
                valid = True
            except GraphError:
                valid = False
            record[algo] = {"order": [position[name] for name in order], "valid": valid,
                            "seconds": round(seconds, 4)}
        results.append(record)
        print(f"{record['id']}: {record['nodes']} nodes", flush=True)
    data = {
        "recorded_with": {"deepspeed": deepspeed.__version__, "torch": __import__("torch").__version__,
                          "budget": None},
        "graphs": results,
    }
    tmp = ORDERS.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")).replace('{"id"', '\n{"id"') + "\n")
    os.replace(tmp, ORDERS)
    print(f"{len(results)} graphs in {time.time() - started:.1f} s -> {ORDERS.relative_to(ROOT)}")


def _deepspeed_prefetch_module(total_memory: list[float]):
    """DeepSpeed's prefetch pass module, cut off from a device and a process group.

    The pass reads the device's memory (``total_memory[0]``, as set by the
    caller), all-reduces it over the ranks (one rank here) and profiles
    all-gathers for its communication model; the stand-ins answer those.
    ``create_predictor`` is replaced per graph by the caller.
    """
    import types

    import torch
    from deepspeed.compile.passes import prefetch

    lib = torch.library.Library("dc", "FRAGMENT")
    lib.define("prefetch_params_fused(int graph_id, Tensor[] params, int[] ids) -> ()")
    lib.define("reload_parameter(Tensor a, int graph_id, int id) -> ()")
    accelerator = types.SimpleNamespace(
        total_memory=lambda: total_memory[0], current_device=lambda: "cpu", available_memory=lambda: 0,
        memory_allocated=lambda: 0, max_memory_allocated=lambda: 0)
    prefetch.get_accelerator = lambda: accelerator
    prefetch.dist = types.SimpleNamespace(get_rank=lambda *a, **k: 0, all_reduce=lambda *a, **k: None,
                                          ReduceOp=types.SimpleNamespace(MIN=None))
    return prefetch, lib


#: Budgets for the prefetch pass, as (fraction of the largest all-gather) added to fast-free's
#: simulated all-tensor peak; None: a device far larger than any corpus graph.
PREFETCH_BUDGETS = (0.0, 0.5, 2.0, 8.0, None)


def record_prefetch() -> None:
    """DeepSpeed's ``schedule_prefetch`` over its fast-free order of every corpus graph.

    Its inputs come from dcsched, as the ``deepcompile`` scheduler computes them
    (:func:`dcsched.schedulers.deepcompile.profiled_inputs`): per node the
    simulated all-tensor memory of fast-free's order (the profiled peak) and
    the all-gather time model fitted to the graph. The device memory is set so
    that DeepSpeed's ``max_mem`` (90% of it, through a float32 tensor) is
    fast-free's peak plus a fraction of the largest all-gather
    (:data:`PREFETCH_BUDGETS`); the recorded ``budget`` is that ``max_mem``.
    Each record stores the pass's output as input positions, a fused
    prefetch as a list of all-gather positions in DeepSpeed's member order.
    """
    import contextlib
    import io
    import types

    import torch

    from dcsched.graph.nxview import check_order, to_networkx
    from dcsched.schedulers.deepcompile import profiled_inputs
    from dcsched.graph.form import ALLGATHER
    from dcsched.sim.simulate import compile_view
    from dcsched.synthetic import graph_digest

    from dcsched.deepspeed import reference_list_schedule, to_deepspeed_graph

    try:
        list_schedule, _ = reference_list_schedule()
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    import deepspeed

    total_memory = [0.0]
    prefetch, _lib = _deepspeed_prefetch_module(total_memory)
    fused_op = torch.ops.dc.prefetch_params_fused.default
    results = []
    started = time.time()
    for entry in corpus():
        graph = build(entry)
        view = to_networkx(graph)
        names = [n.name for n in graph.nodes]
        position = {name: i for i, name in enumerate(names)}
        try:
            ff_graph = list_schedule.fast_free_schedule(to_deepspeed_graph(graph), 0, 0, False)
            ff_order = [n.name for n in ff_graph.nodes]
            check_order(view, ff_order)
        except Exception:  # no valid fast-free order from DeepSpeed: nothing to prefetch
            continue
        compiled = compile_view(view, assume_zero=True)
        ff = [compiled.index[name] for name in ff_order]
        inputs = profiled_inputs(compiled, ff)
        peak, comm_time = inputs["peak"], inputs["comm_time"]
        gathers = [v for v in ff if compiled.kind[v] == ALLGATHER]
        largest = max((compiled.size[v] for v in gathers), default=0)
        gather_of = {(n.args[0].name, n.args[2]): n.name for n in ff_graph.nodes
                     if n.target == torch.ops.dc.allgather_param.default}
        record = {"id": entry_id(entry), "graph": entry, "digest": graph_digest(graph), "nodes": len(names),
                  "comm_model": [comm_time.latency_ms, comm_time.ms_per_byte], "runs": []}
        for fraction in PREFETCH_BUDGETS:
            target = 1e30 if fraction is None else max(peak) + fraction * largest
            total_memory[0] = target / (1 - prefetch.MARGIN)
            budget = torch.tensor([total_memory[0] * (1 - prefetch.MARGIN)])[0].item()  # as the pass does
            mem = [(name, 0, 0, peak[compiled.index[name]]) for name in ff_order]
            sizes = [(name, compiled.size[compiled.index[name]]) for name in ff_order]
            profile = types.SimpleNamespace(fwd_graph=None, bwd_graph=None, fwd_mem_complete=True,
                                            bwd_mem_complete=True, fwd_mem=mem, bwd_mem=mem, fwd_time=[],
                                            bwd_time=[], fwd_tensor_sizes=sizes, bwd_tensor_sizes=sizes)
            prefetch.create_predictor = lambda comm_time=comm_time: comm_time  # this graph's, when the pass calls it
            module = types.SimpleNamespace(graph=to_deepspeed_graph_from(ff_graph))
            run = {"budget": budget}
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    out = prefetch.schedule_prefetch(module, 0, [], {0: profile}, None, 0.0, None, False)
                plan = []
                for n in out.graph.nodes:
                    if n.target == fused_op:
                        plan.append([position[gather_of[(p.name, d)]] for p, d in zip(n.args[1], n.args[2])])
                    else:
                        plan.append(position[n.name])
                run["plan"] = plan
            except Exception as exc:  # recorded: DeepSpeed fails on some graphs
                run["error"] = f"{type(exc).__name__}: {exc}"[:300]
            record["runs"].append(run)
        results.append(record)
        print(f"{record['id']}: {record['nodes']} nodes, {len(gathers)} all-gathers", flush=True)
    data = {"recorded_with": {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                              "pass": "deepspeed.compile.passes.prefetch.schedule_prefetch"},
            "graphs": results}
    path = GOLDEN / "prefetch.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")).replace('{"id"', '\n{"id"') + "\n")
    os.replace(tmp, path)
    print(f"{len(results)} graphs in {time.time() - started:.1f} s -> {path.relative_to(ROOT)}")


def to_deepspeed_graph_from(graph):
    """A fresh copy of a DeepSpeed-op graph (the pass rewrites the graph it is given)."""
    import torch.fx

    new = torch.fx.Graph()
    env = {}
    for node in graph.nodes:
        env[node.name] = new.node_copy(node, lambda n: env[n.name])
    return new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("bundles", "record", "prefetch"))
    args = parser.parse_args()
    {"bundles": make_bundles, "record": record, "prefetch": record_prefetch}[args.step]()


if __name__ == "__main__":
    main()
