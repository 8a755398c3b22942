"""The whole step's peak memory per rank, measured and simulated, on W gloo ranks.

Each run (:data:`RUNS`) trains a model as :mod:`mixed_precision_runs` builds it with AdamW for three steps under
``dcsched.shard`` (fp32, or ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``), scheduled
with ``overlap-plan``. On the last step (the optimizer's states exist) the compiled graphs' peaks are measured
with the parameters, the optimizer's states and the batch counted beside each graph's tensors
(``ScheduledProgram.also_tracked``), and the optimizer's update under its own tracker (parameters, gradients,
states); the measured whole-step peak is the largest of the three. Beside it,
:func:`dcsched.sim.step_memory.step_memory` of the program's bundle with the optimizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

import train_runs as runs

#: The examples' GPT and Llama and a tiny Hugging Face Llama, each in fp32 and under the bf16 policy.
RUNS = [(name, mixed) for name in ("gpt", "llama", "hf-llama") for mixed in (False, True)]


def _states(optimizer) -> list:
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


def train(name: str, mixed: bool, rank: int, world_size: int, steps: int = 3) -> dict:
    import dcsched
    from dcsched.runtime.memtrack import LiveBytes
    from dcsched.sim.step_memory import step_memory
    torch._dynamo.reset()
    from mixed_precision_runs import _batches, _model
    model, _ = _model(name)
    model.train()
    policy = dcsched.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    dcsched.shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=runs.LR)
    backend = dcsched.backend(algo="overlap-plan", cost_model="analytic", gpu="h100")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    update_peak = 0
    held_outputs: list = []
    for step, (args, kwargs) in enumerate(_batches(name, steps, rank, world_size)):
        last = step == steps - 1
        if last:
            program = backend.programs[0]
            program.measure = True
            batch = [*args, *kwargs.values()]
            program.also_tracked = lambda batch=batch: [list(model.parameters()), _states(optimizer), batch,
                                                        held_outputs]
        held_outputs.clear()  # the previous step's outputs: none of this step's
        output = compiled(*args, **kwargs)
        # what the training loop holds across the backward: the model's outputs (a Hugging Face model's logits
        # beside its loss), live in the process though no graph of the backward reads them
        held_outputs[:] = list(output.values()) if isinstance(output, Mapping) else [output]
        loss = output.loss if hasattr(output, "loss") else output
        loss.backward()
        if last:
            with LiveBytes() as tracker:
                tracker.track([list(model.parameters()), [p.grad for p in model.parameters()], _states(optimizer)])
                tracker.reset_peak()
                optimizer.step()
            update_peak = tracker.peak
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    program = backend.programs[0]
    stats = program.stats[-1]
    measured = {"forward": stats.forward.peak_bytes, "backward": stats.backward.peak_bytes, "optimizer": update_peak}
    simulated = step_memory(program.bundle, optimizer, issue=program.runtime.issue.without_staging(), gpu=False)
    return {"measured": max(measured.values()), "measured_phases": measured,
            "simulated": simulated.peak_bytes, "simulated_phases": simulated.phases, "parts": simulated.parts,
            "optimizer_states": sum(v.numel() * v.element_size() for v in _states(optimizer))}


def worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    from dcsched.runtime.distributed import shutdown
    runs.init_gloo(rank, world_size, port)
    try:
        results = {f"{name}-{'bf16' if mixed else 'fp32'}": train(name, mixed, rank, world_size)
                   for name, mixed in RUNS}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        shutdown()


def spawn(out_dir: Path, world_size: int) -> list[dict]:
    """Each rank's results by ``{gpt|hf-llama}-{fp32|bf16}``."""
    import torch.multiprocessing as mp
    out_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(worker, args=(world_size, runs.free_port(), str(out_dir)), nprocs=world_size, join=True)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)]
