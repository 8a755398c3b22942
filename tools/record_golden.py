"""Record DeepSpeed 0.19.8's scheduler orders as golden data for dcsched's differential tests.

Two steps, two interpreters:

1. ``.venv/bin/python tools/record_golden.py bundles`` captures small models of
   several architectures (examples/models.py), profiles them with the analytic
   cost model and saves them as bundles under ``tests/golden/bundles/``, with
   copies of the repository's ``sample_graphs/*.pt`` (so the tests never
   re-capture and the golden inputs cannot drift).
2. ``/work/dsvenv/bin/python tools/record_golden.py record`` runs DeepSpeed
   0.19.8's ``fast_free_schedule`` and ``simple_prefetch`` (no budget) and its
   ``get_last_uses`` on every corpus graph and writes ``tests/golden/orders.json``.

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
    from dcsched import bundle
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
    sys.path.insert(0, str(ROOT / "examples"))
    import dcsched
    from dcsched.capture import capture
    from dcsched.profile import ProfileOptions, profile_bundle
    from models import build as build_model

    BUNDLES.mkdir(parents=True, exist_ok=True)
    for stem, name, config in CAPTURED:
        model, inputs, loss_fn = build_model(name, **config)
        captured = capture(model, inputs, loss_fn=loss_fn)
        profiled = profile_bundle(captured, ProfileOptions(cost_model="analytic", gpu="h100", progress=False))
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

def _prepare_deepspeed():
    import torch

    from dcsched import ops

    ops.ensure_deepspeed_ops()  # stand-in torch.ops.dc.* with DeepSpeed's schemas
    import deepspeed
    import deepspeed.compile.util as ds_util
    from deepspeed.compile import list_schedule

    if deepspeed.__version__ != "0.19.8":
        raise SystemExit(f"need deepspeed 0.19.8, found {deepspeed.__version__}")
    ds_util.dc_handle = object()  # DeepSpeed must not build its extension
    # DeepSpeed's aliasing table lists the aten ops accessed so far (torch.ops.aten
    # iterates those); touch them all so it sees every view, as a long-lived process would.
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        if namespace == "aten":
            try:
                getattr(torch.ops.aten, name.split(".")[0])
            except (AttributeError, RuntimeError):
                pass
    ds_util.get_no_copy_ops.cache_clear()
    sys.setrecursionlimit(1_000_000)
    return list_schedule, ds_util


def _or_zero(value):
    return 0 if value is None else value


def to_deepspeed_graph(graph):
    """A copy of ``graph`` with torch.ops.dc.* comm ops and every cost present (missing -> 0)."""
    import torch
    import torch.fx

    from dcsched.roles import COMM_ROLES, role_of

    new = torch.fx.Graph()
    env = {}
    for node in graph.nodes:
        copy = new.node_copy(node, lambda n: env[n.name])
        if role_of(node) in COMM_ROLES:
            copy.target = getattr(torch.ops.dc, node.target._opname).default
        copy.meta["device_time"] = _or_zero(node.meta.get("device_time"))
        copy.meta["tensor_size"] = _or_zero(node.meta.get("tensor_size"))
        env[node.name] = copy
    return new


def record() -> None:
    from dcsched.nxview import check_order, to_networkx
    from dcsched.errors import GraphError
    from dcsched.synthetic import graph_digest

    list_schedule, ds_util = _prepare_deepspeed()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("bundles", "record"))
    args = parser.parse_args()
    make_bundles() if args.step == "bundles" else record()


if __name__ == "__main__":
    main()
