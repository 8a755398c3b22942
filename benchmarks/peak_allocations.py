"""What each configuration holds at its step's peak, on 2 gloo ranks: the live allocations, by the op that made them.

The configurations, models and sizes of ``bench_train.py --peers`` (``benchmarks/train_peers.py``): each
rank builds them, trains two untimed steps, then profiles one (the torch profiler's allocation events) and
prints, per configuration and rank, the state it holds when the step starts, how far the step's own
allocations rise above it, where the highest point is, and the allocations live there, grouped by the
three innermost ops around each.

``--sync-gathers`` makes dcsched's all-gathers block until they are done, as FSDP2 issues them on gloo
(``unshard_async_op`` is False by default, and the CPU has no stream to run them beside the compute),
whatever the backend chose for the budget (``dcsched.train.backend.asynchrony``). Gloo's all-gather
allocates a full-size buffer of its own in its worker thread for as long as the collective runs;
asynchronous, that buffer lives beside the compute's allocations (the simulator's ``staging`` model,
``dcsched.sim.staging``). ``--memory-budget SIZE`` (or ``fsdp``) is passed to the dcsched configurations.

    python benchmarks/peak_allocations.py --model gpt --config dcsched-fsdp --config fsdp2 --algo fsdp
    python benchmarks/peak_allocations.py --model gpt --config dcsched-fsdp --algo fsdp --sync-gathers
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train_peers as peers  # noqa: E402

#: Groups of live allocations printed per configuration.
GROUPS = 12


def _blocking_gathers() -> None:
    """Make the runtime's all-gathers wait at once (FSDP2's behaviour on gloo), returning completed work."""
    import dcsched.runtime.distributed as runtime

    issue = runtime.all_gather_into_tensor

    class Done:
        def wait(self) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    def blocking(output, source, group=None, async_op=False):
        issue(output, source, group=group, async_op=False)
        return Done() if async_op else None

    runtime.all_gather_into_tensor = blocking


def report(config: peers.Config, batch) -> str:
    """One profiled step of ``config``: its held state, its rise, and what is live at the peak."""
    from torch.profiler import ProfilerActivity, profile

    held = config.held_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        config.step(batch)
    events = peers.allocation_events(prof)
    start = events[0][2] - events[0][1]
    peak = max(range(len(events)), key=lambda i: events[i][2])
    live: dict[int, tuple[int, list[str]]] = {}
    for _t, size, _total, address, names in events[:peak + 1]:
        if size > 0:
            live[address] = (size, names)
        else:
            live.pop(address, None)
    groups: collections.Counter = collections.Counter()
    for size, names in live.values():
        groups[" < ".join(names[:3])] += size
    lines = [f"{config.name} rank {dist.get_rank()}: holds {held / 2**20:.2f} MiB, the step rises "
             f"{(events[peak][2] - start) / 2**20:.2f} MiB above it; the peak in {' < '.join(events[peak][4][:3])}"]
    lines += [f"  {size / 2**20:8.3f} MiB  {where}" for where, size in groups.most_common(GROUPS)]
    return "\n".join(lines)


def worker(rank: int, world_size: int, port: int, family: str, args) -> None:
    torch.set_num_threads(1)
    if args.sync_gathers:
        _blocking_gathers()
    from dcsched.runtime import distributed
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    distributed.init("cpu")  # gloo, from the environment above
    try:
        per_rank = args.batch // world_size
        batches = peers._batches(rank, per_rank, args.size)
        for name in args.configs:
            if name == "ddp" and "ddp" not in (args.config or []):
                continue  # train_peers adds DDP for its loss comparison: not asked for here
            config = peers.Config(name, family, args, per_rank)
            config.setup()
            for batch in batches[:2]:
                config.step(batch)
            text = report(config, batches[2])
            for r in range(world_size):  # one rank's report at a time
                if r == rank:
                    print(text, flush=True)
                dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    import torch.multiprocessing as mp

    sync = "--sync-gathers" in argv
    args = peers.arguments([a for a in argv if a != "--sync-gathers"])
    args.sync_gathers = sync
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for family in args.models:
        mp.spawn(worker, args=(args.world_size, peers._free_port(), family, args), nprocs=args.world_size,
                 join=True)


if __name__ == "__main__":
    main(sys.argv[1:])
