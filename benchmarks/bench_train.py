"""Training step time under dcsched against plain ``torch.compile``, and per algorithm on a GPU.

CPU (default): one rank, algorithm ``none``: the same small GPT (``dcsched.examples``, seeded, AdamW) trained
under plain ``torch.compile(model, dynamic=False)`` with its default backend (inductor) and under
``dcsched.shard`` + ``torch.compile(model, backend=dcsched.backend(algo="none", compute=C))`` for each
``--compute`` C (default both: ``eager``, ``inductor``). A step is forward, backward, ``optimizer.step()`` and
``zero_grad``. All are compiled and warmed up first; then, ``--repeats`` times and taking turns,
``--steps`` steps are timed one by one: the figure is the median step of a repeat, best over the repeats.
The ratio dcsched / plain is issue 9's overhead figure (target <= 1.10). Beside them, the same under
``backend="aot_eager"`` (AOT autograd's aten graphs run eagerly, which is how ``compute="eager"`` runs the
scheduled graphs): ``ratio_aot_eager``.

``--device cuda``: per algorithm (``none``, ``fast-free``, ``overlap``, or ``--algo``) and ``--compute``, the
measured step time (CUDA-synchronised median, best of repeats) and the step's peak CUDA memory above what was
allocated before it, beside the simulator's step time and peak for the scheduled graphs (``cost_model="measured"``: the
backend profiles on the GPU). Under ``torchrun --nproc-per-node 2`` the ranks train over NCCL; rank 0 prints.

    .venv/bin/python benchmarks/bench_train.py                       # CPU, none: plain vs dcsched
    .venv/bin/python benchmarks/bench_train.py --device cuda --json
    .venv/bin/python benchmarks/bench_train.py --peers               # 2 gloo ranks: dcsched, FSDP2, DDP, DeepSpeed

``--peers`` (every option after it is its own, see ``--peers --help``): dcsched against FSDP2, DDP and
DeepSpeed ZeRO-3 on 2 gloo ranks, in one invocation (``benchmarks/train_peers.py``).
    torchrun --nproc-per-node 2 benchmarks/bench_train.py --device cuda --set n_layers=8 --set d_model=1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import dcsched
from dcsched.examples import build

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_peers, beside this file


#: The GPT example's size: ``dcsched.examples.build("gpt", **GPT)``.
GPT = {"n_layers": 2, "d_model": 128, "n_heads": 4, "vocab": 512, "seq": 64, "batch": 4}


def _arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--algo", action="append", help="algorithm (repeatable); default: none on the CPU, "
                        "none, fast-free and overlap on a GPU")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per repeat")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=N",
                        help=f"the model's size (dcsched.examples.build), default {GPT}")
    parser.add_argument("--memory-budget", default=None, help="overlap's budget (default: the device's less 10%%)")
    parser.add_argument("--compute", action="append", choices=("eager", "inductor"),
                        help="how dcsched runs the scheduled graphs' compute (repeatable); default both")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    if min(args.steps, args.repeats) < 1 or args.warmup < 0:
        parser.error("--steps and --repeats must be at least 1, --warmup at least 0")
    args.compute = args.compute or ["eager", "inductor"]
    from train_peers import model_sizes
    args.model = model_sizes(parser, args.set, GPT)
    return args


class Trainer:
    """One compiled model, its optimizer and a seeded token stream; :meth:`step` trains one step."""

    def __init__(self, args, device: str, backend=None, rank: int = 0, world_size: int = 1,
                 plain_backend: str = "inductor") -> None:
        torch.manual_seed(0)
        self.model, _, _ = build("gpt", device=device, **args.model)
        if backend is not None:
            dcsched.shard(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.compiled = (torch.compile(self.model, backend=plain_backend, dynamic=False) if backend is None
                         else torch.compile(self.model, backend=backend, dynamic=False))
        self.backend, self.device = backend, torch.device(device)
        generator = torch.Generator().manual_seed(rank)
        shape = (args.model["batch"], args.model["seq"] + 1)
        self.batches = [torch.randint(0, args.model["vocab"], shape, generator=generator).to(device)
                        for _ in range(8)]
        self.count = 0

    def step(self) -> float:
        tokens = self.batches[self.count % len(self.batches)]
        self.count += 1
        loss = self.compiled(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def timed(self, steps: int) -> tuple[float, int | None]:
        """Median milliseconds of ``steps`` steps, and (CUDA) the largest step's peak above its start."""
        cuda = self.device.type == "cuda"
        times, peak = [], None
        for _ in range(steps):
            if cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                before = torch.cuda.memory_allocated(self.device)
            start = time.perf_counter()
            self.step()
            if cuda:
                torch.cuda.synchronize(self.device)
            times.append((time.perf_counter() - start) * 1e3)
            if cuda:
                peak = max(peak or 0, torch.cuda.max_memory_allocated(self.device) - before)
        return statistics.median(times), peak


def _best(trainers: dict, args) -> dict:
    """Warm every trainer up, then time them in turn ``args.repeats`` times; the best median of each."""
    for trainer in trainers.values():
        for _ in range(1 + args.warmup):  # the first step compiles
            trainer.step()
    best: dict = {name: (float("inf"), None) for name in trainers}
    for _ in range(args.repeats):
        for name, trainer in trainers.items():
            ms, peak = trainer.timed(args.steps)
            best[name] = (min(best[name][0], ms), max(best[name][1] or 0, peak or 0) or None)
    return best


def _label(args) -> str:
    model = args.model
    return f"gpt {model['n_layers']}x{model['d_model']} seq {model['seq']} batch {model['batch']}"


def cpu_rows(args) -> list[dict]:
    algo = (args.algo or ["none"])[0]
    trainers = {"plain": Trainer(args, "cpu"), "aot_eager": Trainer(args, "cpu", plain_backend="aot_eager")}
    for compute in args.compute:
        backend = dcsched.backend(algo=algo, cost_model="analytic", gpu="h100", compute=compute)
        trainers[compute] = Trainer(args, "cpu", backend)
    best = _best(trainers, args)
    plain, aot = best["plain"][0], best["aot_eager"][0]
    rows = []
    for compute in args.compute:
        ours = best[compute][0]
        rows.append({"model": _label(args), "algo": algo, "compute": compute,
                     "steps": args.steps, "repeats": args.repeats, "plain_ms": round(plain, 3),
                     "dcsched_ms": round(ours, 3), "ratio": round(ours / plain, 3), "aot_eager_ms": round(aot, 3),
                     "ratio_aot_eager": round(ours / aot, 3), "threads": torch.get_num_threads(),
                     "load": round(os.getloadavg()[0], 1)})
    return rows


def _init_distributed() -> tuple[int, int]:
    from dcsched.runtime import distributed
    if not distributed.launched():
        return 0, 1
    launch = distributed.init("cuda")
    return launch.rank, launch.world_size


def cuda_rows(args) -> list[dict]:
    rank, world_size = _init_distributed()
    device = f"cuda:{torch.cuda.current_device()}"
    rows = []
    for algo in args.algo or ["none", "fast-free", "overlap"]:
        budget = args.memory_budget if algo == "overlap" else None
        for compute in args.compute:
            torch._dynamo.reset()
            backend = dcsched.backend(algo=algo, memory_budget=budget, compute=compute)
            trainer = Trainer(args, device, backend, rank, world_size)
            (ms, peak), = _best({algo: trainer}, args).values()
            simulated = backend.programs[0].simulated or {}
            rows.append({"model": _label(args), "algo": algo, "compute": compute, "world_size": world_size,
                         "steps": args.steps, "step_ms": round(ms, 3), "sim_step_ms": simulated.get("step_ms"),
                         "peak_bytes": peak, "sim_peak_bytes": simulated.get("peak_bytes")})
            del trainer
    return rows if rank == 0 else []


def _table(rows: list[dict]) -> str:
    keys = list(rows[0])
    cells = [[str(row.get(key, "")) for key in keys] for row in rows]
    widths = [max(len(key), *(len(c[i]) for c in cells)) for i, key in enumerate(keys)]
    lines = ["  ".join(key.ljust(w) for key, w in zip(keys, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--peers" in argv:
        import train_peers
        argv.remove("--peers")
        train_peers.main(argv)
        return
    args = _arguments(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_train: --device cuda needs a CUDA GPU")
    rows = cuda_rows(args) if args.device == "cuda" else cpu_rows(args)
    if rows:
        print(json.dumps(rows, indent=2) if args.json else _table(rows))


if __name__ == "__main__":
    main()
