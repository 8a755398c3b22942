"""Measured against simulated on one device, for every algorithm: the driver of ``benchmarks/gpu_check.sh``.

For each example model (GPT, Llama, ConvNet from :mod:`dcsched.examples`):

1. capture one training step on ``--device`` and profile it twice: ``measured``
   there (CUDA events on a GPU) and ``analytic`` for the matching GPU;
2. schedule the measured bundle with every algorithm (``dcsched schedule --algo
   all``; overlap at its default budget, the bundle's device memory less 10%);
3. replay each schedule beside the unscheduled bundle (``replay_orders``, i.e.
   ``dcsched replay --baseline``): measured step time and peak memory
   (``torch.cuda.max_memory_allocated`` on a GPU) next to the simulator's, and
   whether both orders computed identical results;
4. per graph, the Spearman rank correlation of the algorithms' measured and
   simulated step times; over all graphs, the median measured / analytic time
   per op kind, written as a calibration file ``profile --calibration`` loads.

Writes ``gpu_check.json``, ``gpu_check.md`` and ``calibration.json`` under ``--out``.
``--device cpu --tiny`` runs the same flow on tiny models in seconds (the test suite does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dcsched.bundle import core as bundle_io
from dcsched.profile.capture import capture_step
from dcsched.cli import run as cli
from dcsched.costmodels import fit_calibration
from dcsched.costmodels.formulas import GPUS
from dcsched.errors import ResultMismatch
from dcsched.examples import build
from dcsched.costmodels.options import ProfileOptions
from dcsched.profile.measure import profile_bundle
from dcsched.replay import replay_orders
from dcsched.schedulers import available

#: Sizes for one H100: a few seconds of profiling each, big enough that kernels dominate launches.
FULL = {
    "gpt": dict(n_layers=4, d_model=1024, n_heads=16, vocab=8192, seq=512, batch=8),
    "llama": dict(n_layers=4, d_model=1024, n_heads=16, vocab=8192, seq=512, batch=8),
    "convnet": dict(n_layers=4, width=128, image=64, batch=64),
}
TINY = {
    "gpt": dict(n_layers=1, d_model=16, n_heads=2, vocab=32, seq=8, batch=2),
    "llama": dict(n_layers=1, d_model=16, n_heads=2, vocab=32, seq=8, batch=2),
    "convnet": dict(n_layers=1, width=8, image=8, batch=2),
}


def gpu_key(device: torch.device) -> str:
    """The ``GPUS`` entry for the card in use (H100 when it is none of them, or on the CPU)."""
    name = torch.cuda.get_device_name(device).lower() if device.type == "cuda" else ""
    return next((key for key in GPUS if key in name), "h100")


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None with fewer than two distinct values.

    >>> spearman([1, 2, 3], [10, 30, 20])
    0.5
    """
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return result

    if len(xs) < 2 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def profile_pair(name: str, config: dict, device: torch.device, key: str, iters: int, warmup: int, out: Path):
    """(analytic bundle, measured bundle path and bundle) of one example model's step."""
    model, inputs, loss_fn = build(name, device=device, **config)
    captured = capture_step(model, inputs, loss_fn)
    common = dict(world_size=1, progress=False)
    measured = profile_bundle(captured.bundle, ProfileOptions(
        cost_model="measured", device=str(device), iters=iters, warmup=warmup,
        gpu=None if device.type == "cuda" else key, **common), params=captured.params, inputs=captured.inputs)
    analytic = profile_bundle(captured.bundle, ProfileOptions(cost_model="analytic", gpu=key, **common))
    path = out / f"{name}.pt"
    bundle_io.save(measured, path)
    return analytic, path, measured


def check_graph(name: str, path: Path, device: torch.device, iters: int, warmup: int) -> dict:
    """Schedule ``path`` with every algorithm and replay each beside the baseline."""
    algos = available()
    code = cli(["schedule", str(path), "--algo", "all", "-o", str(path.with_suffix(".sched.pt")), "--force"])
    if code != 0:
        raise SystemExit(f"dcsched schedule failed on {path} (exit {code})")
    baseline = bundle_io.load(path)
    rows = []
    for algo in algos:
        scheduled = path.with_name(f"{path.stem}.sched.{algo}.pt")
        row = {"graph": name, "algo": algo}
        try:
            report = replay_orders(bundle_io.load(scheduled), baseline, device=device, iters=iters, warmup=warmup)
            order = report.orders[-1]
            row.update(equal=True, measured=order.measured.to_dict(), simulated=order.simulated,
                       error_percent=order.errors())
        except ResultMismatch as exc:
            row.update(equal=False, mismatch=str(exc))
        rows.append(row)
    timed = [r for r in rows if r.get("simulated")]
    rho = spearman([r["measured"]["step_ms"] for r in timed], [r["simulated"]["step_ms"] for r in timed])
    return {"graph": name, "rows": rows, "spearman_step_ms": rho}


def _pct(value) -> str:
    return "" if value is None else f"{value:+.1f}%"


def _mib(value) -> str:
    return "" if value is None else f"{value / 2**20:.1f}"


def markdown(result: dict) -> str:
    lines = [f"# gpu_check: {result['device']}", "",
             f"torch {result['torch']}, {'tiny' if result['tiny'] else 'full'} models, {result['seconds']:.0f} s.",
             "", "| graph | algo | measured ms | simulated ms | time error | measured peak MiB | "
             "simulated peak MiB | peak error | equal |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for graph in result["graphs"]:
        for r in graph["rows"]:
            m, s = r.get("measured") or {}, r.get("simulated") or {}
            e = r.get("error_percent") or {}
            lines.append(f"| {r['graph']} | {r['algo']} | {m.get('step_ms') or 0:.3f} | {s.get('step_ms') or 0:.3f} | "
                         f"{_pct(e.get('step_ms'))} | {_mib(m.get('peak_bytes'))} | {_mib(s.get('peak_bytes'))} | "
                         f"{_pct(e.get('peak_bytes'))} | {'yes' if r['equal'] else 'NO'} |")
    lines += ["", "| graph | Spearman rho (algorithms' measured vs simulated step time) |", "|---|---:|"]
    for graph in result["graphs"]:
        rho = graph["spearman_step_ms"]
        lines.append(f"| {graph['graph']} | {'' if rho is None else format(rho, '.2f')} |")
    cal = result["calibration"]
    lines += ["", f"Calibration (measured / analytic {cal['gpu']}, median by op kind; default {cal['default']:.3g}):",
              "", "| op kind | factor | nodes |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:.3g} | {cal['samples'].get(k, 0)} |" for k, v in cal["factors"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny models, one timed run: a dry run in seconds")
    parser.add_argument("--out", type=Path, default=Path("gpu_check"), help="folder for the results")
    parser.add_argument("--models", default="gpt,llama,convnet")
    args = parser.parse_args(argv)
    started = time.time()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (use --device cpu --tiny for a dry run)", file=sys.stderr)
        return 2
    key = gpu_key(device)
    iters, warmup = (1, 0) if args.tiny else (10, 3)
    args.out.mkdir(parents=True, exist_ok=True)
    configs = TINY if args.tiny else FULL
    pairs, graphs = [], []
    for name in args.models.split(","):
        analytic, path, measured = profile_pair(name, configs[name], device, key, iters, warmup, args.out)
        pairs.append((analytic, measured))
        graphs.append(check_graph(name, path, device, iters, warmup))
        print(f"gpu_check: {name} done ({time.time() - started:.0f} s)", file=sys.stderr)
    calibration = fit_calibration(pairs, key, pairs[0][1].provenance["device"])
    calibration.save(args.out / "calibration.json")
    result = {"device": pairs[0][1].provenance["device"], "gpu": key, "torch": torch.__version__,
              "tiny": args.tiny, "graphs": graphs, "calibration": calibration.to_dict(),
              "seconds": time.time() - started}
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (args.out / "gpu_check.md").write_text(markdown(result))
    print((args.out / "gpu_check.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
