"""Where the time to dcsched's first step goes, beside eager FSDP2's and DDP's, on 2 gloo ranks.

Measured as ``benchmarks/train_peers.py`` measures its "first step s" (its configurations, models and batches):
each rank compiles and trains a tiny module first (so nobody pays for the compiler's imports), then per
configuration, from a barrier, construction (build, shard or wrap, optimizer) + compile + the first step
(forward, backward, the optimizer's step); the maximum over the ranks. dcsched's configurations:

* ``dcsched``: ``dcsched.backend()`` (the default planner, profiling and planning at the first step);
* ``dcsched-plan-write``: ``dcsched.backend(plan=FILE)`` with FILE absent (profiles, plans, writes FILE);
* ``dcsched-plan-reuse``: the same FILE, now present (no profile, no planning).

On rank 0 the dcsched rows also say where their first step went: each of dcsched's phases, timed by
wrapping its function (TorchDynamo's trace before the backend is the rest of ``compile``), and ``--cprofile
DIR`` writes rank 0's cProfile of each dcsched row's first step to ``DIR/<model>-<config>.prof`` (read it with
``python -m pstats``).

    python benchmarks/first_step.py --model gpt --model llama
    python benchmarks/first_step.py --model gpt --config dcsched --cprofile /tmp/prof
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = ("dcsched", "dcsched-plan-write", "dcsched-plan-reuse", "fsdp2", "ddp")
#: dcsched's phases on the first step: (label, module, function name), each wrapped with a timer on rank 0.
PHASES = (
    ("capture (AOT autograd)", "dcsched.train.backend", "capture_compiled"),
    ("agreement", "dcsched.train.agreement", "announce"),
    ("topology", "dcsched.train.backend", "profile_topology"),
    ("profile", "dcsched.train.backend", "profile_bundle"),
    ("steady figures", "dcsched.train.backend", "steady_figures"),
    ("plan (scheduler)", "dcsched.train.backend", "run_step"),
    ("issue ways", "dcsched.train.backend", "asynchrony"),
    ("read stored plan", "dcsched.train.stored_plan", "read"),
    ("reuse stored plan", "dcsched.train.stored_plan", "reused"),
    ("write stored plan", "dcsched.train.stored_plan", "write"),
    ("plan check", "dcsched.train.backend", "check_same"),
    ("simulated figures", "dcsched.sim.bundle_figures", "simulated_figures"),
    ("program", "dcsched.train.backend", "ScheduledProgram"),
    ("backend (all of the above)", "dcsched.train.backend", "compile_program"),
)


def _timed_phases(spent: dict[str, float]) -> contextlib.ExitStack:
    """Wrap each of :data:`PHASES` so that its time adds to ``spent[label]``; undone when the stack closes."""
    import importlib
    stack = contextlib.ExitStack()
    for label, module_name, name in PHASES:
        module = importlib.import_module(module_name)
        original = getattr(module, name)

        def timed(*args, __original=original, __label=label, **kwargs):
            start = time.perf_counter()
            try:
                return __original(*args, **kwargs)
            finally:
                spent[__label] = spent.get(__label, 0.0) + time.perf_counter() - start

        setattr(module, name, timed)
        stack.callback(setattr, module, name, original)
    return stack


def worker(rank: int, world_size: int, port: int, family: str, args, out_dir: str) -> None:
    """mp.spawn target: every configuration's first step on this rank; results to ``out_dir/rank<r>.json``."""
    import torch.distributed as dist

    import train_peers
    from dcsched.runtime import distributed
    os.dup2(2, 1)
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    distributed.init("cpu", timeout=datetime.timedelta(seconds=600))
    train_peers._warm_compilers(False)
    peers_args = argparse.Namespace(size=args.size, form="none", mp_policy="none", memory_budget=None)
    per_rank = args.batch // world_size
    batch = train_peers._batches(rank, per_rank, args.size)[0]
    plan_file = str(Path(out_dir, f"{family}-plan.pt"))
    results: dict[str, dict] = {}
    try:
        for name in args.configs:
            import dcsched
            config = train_peers.Config("dcsched-overlap-plan" if name.startswith("dcsched") else name, family,
                                        peers_args, per_rank)
            spent: dict[str, float] = {}
            original_backend = dcsched.backend
            if name.startswith("dcsched-plan"):
                dcsched.backend = functools.partial(original_backend, plan=plan_file)
            profiler = None
            torch._dynamo.reset()
            dist.barrier()
            with _timed_phases(spent) if rank == 0 and name.startswith("dcsched") else contextlib.nullcontext():
                if rank == 0 and args.cprofile and name.startswith("dcsched"):
                    import cProfile
                    profiler = cProfile.Profile()
                    profiler.enable()
                start = time.perf_counter()
                config.setup()
                built = time.perf_counter()
                loss = config.run(*batch)
                forward = time.perf_counter()
                loss.backward()
                config.optimizer.step()
                config.optimizer.zero_grad(set_to_none=True)
                end = time.perf_counter()
                if profiler is not None:
                    profiler.disable()
            dcsched.backend = original_backend
            results[name] = {"first_step_s": end - start, "construction_s": built - start,
                             "compile_and_forward_s": forward - built, "backward_and_optimizer_s": end - forward,
                             "phases_s": spent}
            if name.startswith("dcsched") and config.backend.programs:
                results[name]["reused_plan"] = config.backend.programs[0].reused_plan
            if profiler is not None:
                Path(args.cprofile).mkdir(parents=True, exist_ok=True)
                profiler.dump_stats(str(Path(args.cprofile, f"{family}-{name}.prof")))
            dist.barrier()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=("gpt", "llama"))
    parser.add_argument("--config", action="append", choices=CONFIGS)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cprofile", metavar="DIR", help="write the dcsched rows' cProfile (rank 0) to DIR")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import train_peers
    args.size = dict(train_peers.SIZE)
    args.configs = args.config or list(CONFIGS)
    import torch.multiprocessing as mp
    rows = []
    for family in args.model or ["gpt"]:
        with tempfile.TemporaryDirectory(prefix="dcsched-first-") as out_dir:
            mp.spawn(worker, args=(2, _free_port(), family, args, out_dir), nprocs=2, join=True)
            ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(2)]
        for name in args.configs:
            row = {"model": family, "config": name,
                   "first_step_s": round(max(rank[name]["first_step_s"] for rank in ranks), 2),
                   **{key: round(ranks[0][name][key], 2) for key in
                      ("construction_s", "compile_and_forward_s", "backward_and_optimizer_s")},
                   "phases_s": {key: round(value, 3) for key, value in ranks[0][name]["phases_s"].items()}}
            if "reused_plan" in ranks[0][name]:
                row["reused_plan"] = ranks[0][name]["reused_plan"]
            rows.append(row)
    load = os.getloadavg()[0]
    if args.json:
        print(json.dumps({"load": load, "rows": rows}, indent=1))
    else:
        print(f"load average {load:.1f}")
        for row in rows:
            phases = ", ".join(f"{k} {v}" for k, v in row["phases_s"].items())
            print(f"{row['model']:6} {row['config']:20} first step {row['first_step_s']:6.2f} s  (construction "
                  f"{row['construction_s']}, compile+forward {row['compile_and_forward_s']}, backward+optimizer "
                  f"{row['backward_and_optimizer_s']})" + (f"\n{'':28}{phases}" if phases else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
