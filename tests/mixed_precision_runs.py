"""dcsched and FSDP2 side by side on gloo ranks, in full precision and under a bf16 mixed-precision policy.

:func:`spawn` trains the examples' GPT and a tiny Hugging Face Llama with AdamW on W gloo ranks, four ways each:
dcsched (``dcsched.shard(mp_policy=...)``, scheduled with ``overlap-plan``: buckets and kept parameters) and
FSDP2 (``fully_shard`` per block then the root, ``mp_policy=...``), each in fp32 and under
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``. Per run: each step's loss (the mean over
the ranks) and the all-gathers and reduce-scatters the last step issued, as (input dtype, input bytes), recorded
by wrapping the collectives the two call (``torch.distributed.all_gather_single`` / ``reduce_scatter_single``,
and dcsched's runtime's names for them).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

import train_runs as runs

LR = 1e-2
MODELS = ("gpt", "hf-llama")


def bf16_policy(fsdp2: bool):
    if fsdp2:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    else:
        from dcsched import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@contextlib.contextmanager
def recorded_collectives(log: list):
    """Append ``(kind, input dtype, input bytes)`` to ``log`` for every all-gather and reduce-scatter issued."""
    import torch.distributed as dist

    import dcsched.runtime.distributed as zero3

    def wrapped(kind, call, input_at, input_name):
        def collective(*args, **kwargs):
            source = args[input_at] if len(args) > input_at else kwargs[input_name]
            log.append((kind, str(source.dtype).removeprefix("torch."), source.numel() * source.element_size()))
            return call(*args, **kwargs)
        return collective

    names = [(dist, "all_gather_single", "gather", 1, "input_tensor"),
             (dist, "reduce_scatter_single", "reduce", 1, "input"),
             (zero3, "all_gather_into_tensor", "gather", 1, "input_tensor"),
             (zero3, "reduce_scatter_tensor", "reduce", 1, "input")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, *_ in names]
    try:
        for owner, name, kind, at, keyword in names:
            setattr(owner, name, wrapped(kind, getattr(owner, name), at, keyword))
        yield log
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _model(name: str):
    if name == "hf-llama":
        import hf_models
        return hf_models.build("llama"), lambda model: list(model.model.layers)
    model, _ = runs.model_of(name)
    return model, lambda model: list(model.blocks)


def _batches(name: str, steps: int, rank: int, world_size: int) -> list:
    if name == "hf-llama":  # every rank the same batch: the mean is the one process's loss
        import hf_models
        return [((), batch) for batch in hf_models.batches("llama", steps)]
    return [(runs.local_slice(inputs, rank, world_size), {})
            for inputs in runs.global_batches(name, steps, 2 * world_size)]


def train(name: str, peer: str, mixed: bool, steps: int, rank: int, world_size: int) -> dict:
    """Losses of ``steps`` AdamW steps and the collectives of the last one (see the module docstring)."""
    torch._dynamo.reset()
    model, blocks = _model(name)
    model.train()
    if peer == "dcsched":
        import dcsched
        dcsched.shard(model, mp_policy=bf16_policy(False) if mixed else None)
        backend = dcsched.backend(algo="overlap-plan", cost_model="analytic", gpu="h100")
        run = torch.compile(model, backend=backend, dynamic=False)
    else:
        from torch.distributed.fsdp import fully_shard
        policy = {"mp_policy": bf16_policy(True)} if mixed else {}
        for block in blocks(model):
            fully_shard(block, **policy)
        fully_shard(model, **policy)
        run = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, log = [], []
    batches = _batches(name, steps, rank, world_size)
    for step, (args, kwargs) in enumerate(batches):
        if peer == "dcsched" and step == len(batches) - 1:
            backend.programs[0].measure = True  # the last step's peaks, beside the simulator's
        with recorded_collectives(log) if step == len(batches) - 1 else contextlib.nullcontext():
            output = run(*args, **kwargs)
            loss = output.loss if hasattr(output, "loss") else output
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(runs.mean_over_ranks(loss.float()))
    masters = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    result = {"losses": losses, "collectives": log, "master_dtypes": masters}
    if peer == "dcsched":
        result["memory"] = _peaks(backend.programs[0])
    return result


def _peaks(program) -> dict:
    """Per graph of the last step: (measured peak bytes, the simulator's for the program's plan)."""
    from dcsched.plan import Plan
    from dcsched.sim.plans import simulate_plan
    from dcsched.sim.simulate import compile_view
    stats = program.stats[-1]
    return {graph: (getattr(stats, graph).peak_bytes,
                    simulate_plan(compile_view(program.bundle.graphs[graph]), program.bundle.plans.get(graph)
                                  or Plan(()), graph, issue=program.runtime.issue.without_staging()).peak_bytes)
            for graph in ("forward", "backward")}


def worker(rank: int, world_size: int, port: int, out_dir: str, steps: int, models: tuple[str, ...] = MODELS) -> None:
    from dcsched.runtime.distributed import shutdown
    runs.init_gloo(rank, world_size, port)
    try:
        results = {f"{name}-{peer}-{'bf16' if mixed else 'fp32'}": train(name, peer, mixed, steps, rank, world_size)
                   for name in models for peer in ("dcsched", "fsdp2") for mixed in (False, True)}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        shutdown()


def spawn(out_dir: Path, world_size: int, steps: int, models: tuple[str, ...] = MODELS) -> list[dict]:
    """Each rank's results by ``{model}-{dcsched|fsdp2}-{fp32|bf16}`` for each of ``models``."""
    import torch.multiprocessing as mp
    out_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(worker, args=(world_size, runs.free_port(), str(out_dir), steps, models), nprocs=world_size, join=True)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)]
