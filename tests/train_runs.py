"""Training runs the train tests compare: dcsched (Python API, any world size) and plain eager PyTorch.

Every run draws the same global batches (seeded) and the same initial model
(``examples/models.py``, seeded); a rank of a W-rank run trains on its
1/W slice of each global batch and reports the mean of the ranks' losses.
"""

from __future__ import annotations

import datetime
import socket
from pathlib import Path

import torch

from dcsched.collective_issue import SIMULATOR
from dcsched.examples import build

#: Tiny configurations: a step takes milliseconds.
CONFIGS = {
    "gpt": {"n_layers": 1, "d_model": 32, "n_heads": 2, "vocab": 64, "seq": 8},
    "llama": {"n_layers": 1, "d_model": 32, "n_heads": 2, "vocab": 64, "seq": 8},
    "convnet-bn": {"n_layers": 1, "width": 8, "n_classes": 4, "image": 16, "norm": "batch"},
}
LR = 1e-2
#: The per-graph memory budget (bytes, all tensors) of conftest's budgeted 2-rank GPT overlap run: above
#: fast-free's peaks (forward 99584, backward 97664 at 2 ranks) and below unlimited overlap's backward (138880).
OVERLAP_BUDGET = 110_000
#: The step after which conftest's 2-rank GPT fast-free run checkpoints.
CHECKPOINT_AT = 10


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float = 60.0) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def model_of(name: str, device: str = "cpu", **overrides):
    family = name.split("-")[0]
    config = {**CONFIGS[name], **overrides}
    model, _, _ = build(family, seed=0, batch=1, device=device, **config)
    return model, config


def global_batches(name: str, steps: int, batch: int, **overrides) -> list[tuple[torch.Tensor, ...]]:
    config = {**CONFIGS[name], **overrides}
    generator = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        if name.startswith("convnet"):
            images = torch.randn(batch, 3, config["image"], config["image"], generator=generator)
            out.append((images, torch.randint(0, config["n_classes"], (batch,), generator=generator)))
        else:
            tokens = torch.randint(0, config["vocab"], (batch, config["seq"] + 1), generator=generator)
            out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def local_slice(inputs, rank: int, world_size: int):
    size = inputs[0].shape[0] // world_size
    return tuple(t[rank * size:(rank + 1) * size].clone() for t in inputs)  # its own storage, as a loader gives


def mean_over_ranks(value: torch.Tensor) -> float:
    import torch.distributed as dist
    value = value.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def train_dcsched(name: str, algo: str, steps: int, batch: int, rank: int = 0, world_size: int = 1,
                  memory_budget=None, budget_scope=None, save: tuple | None = None, resume: str | None = None,
                  device: str = "cpu", compute: str = "eager", cost_model: str = "analytic", replicate_below: int = 0,
                  clip: float | None = None, full_state: bool = False, activation_memory_budget: float | None = None,
                  plan_file: str | None = None,
                  **overrides) -> dict:
    """Losses per step and, for the last step, each graph's measured peak bytes beside the simulator's.

    ``cost_model``: ``analytic`` (h100: the same figures on every rank) or ``measured`` (dcsched's default:
    each rank times its own nodes). ``plan``: per compiled graph, the scheduled node order's digest.

    ``save=(path, k)`` checkpoints after step k (the run goes on); ``resume=path`` loads a checkpoint before the
    first step and trains from the step it was taken after (the losses returned are those steps').

    ``replicate_below``: ``dcsched.shard``'s; ``clip``: clip the gradient norm to it every step (``norms``: the
    norms ``clip_grad_norm_`` returned); ``full_state``: the model's ``state_dict()`` after the last step
    (``state``). ``activation_memory_budget``: ``torch._functorch.config``'s, while the run compiles and trains.
    ``saved``: the bytes the step saves for its backward, and would without checkpointing (None: it does not
    checkpoint). ``plan_file``: ``dcsched.backend(plan=...)`` (``reused_plan``: whether the plan came from it;
    ``plan_digest``: per graph, a digest of its order, buckets and residency).
    """
    import dcsched
    from dcsched.plan import Plan
    from comm_counts import planned_collectives
    from dcsched.runtime.commplan import comm_plan
    from dcsched.sim.plans import kept_ids, simulate_plan
    from dcsched.sim.simulate import compile_view
    if activation_memory_budget is not None:
        from torch._functorch import config as functorch_config
        with functorch_config.patch(activation_memory_budget=activation_memory_budget):
            return train_dcsched(name, algo, steps, batch, rank, world_size, memory_budget, budget_scope, save, resume,
                                 device, compute, cost_model, replicate_below, clip, full_state, plan_file=plan_file,
                                 **overrides)
    torch._dynamo.reset()
    model, _ = model_of(name, device, **overrides)
    dcsched.shard(model, replicate_below=replicate_below)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    backend = dcsched.backend(algo=algo, memory_budget=memory_budget, budget_scope=budget_scope,
                              cost_model=cost_model, gpu="h100" if cost_model == "analytic" else None,
                              compute=compute, plan=plan_file)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    start = int(dcsched.load_checkpoint(resume, model, optimizer)["step"]) if resume else 0
    losses, norms = [], []
    for step, inputs in enumerate(global_batches(name, steps, batch, **overrides)):
        if step < start:
            continue
        if step == steps - 1 and backend.programs:
            backend.programs[0].measure = True
        loss = compiled(*(t.to(device) for t in local_slice(inputs, rank, world_size)))
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(mean_over_ranks(loss))
        if save is not None and step + 1 == save[1]:
            dcsched.save_checkpoint(save[0], model, optimizer, extra={"step": step + 1})
    program = backend.programs[0]
    stats = program.stats[-1]
    plan = {name: order_digest(graph) for name, graph in program.bundle.graphs.items()}
    if compute != "eager":  # inductor's kernels allocate outside the tracker's sight: times only
        return {"losses": losses, "memory": None, "plan": plan}
    # the simulator runs the program's plan, reduce-scatters as the process group runs them (one in flight)
    simulated = {graph: simulate_plan(compile_view(program.bundle.graphs[graph]),
                                      program.bundle.plans.get(graph) or Plan(()), graph,
                                      issue=program.runtime.issue.without_staging() if world_size > 1
                                      else SIMULATOR).peak_bytes
                 for graph in ("forward", "backward")}
    memory = {graph: (getattr(stats, graph).peak_bytes, simulated[graph]) for graph in ("forward", "backward")}
    collectives = {"issued": sum(getattr(program.runtime, "issued", {}).values()),
                   "planned": planned_collectives(program.bundle.graphs,
                                                  comm_plan(program.bundle.plans, program.bundle.graph_ids)),
                   "buckets": sum(len(p.buckets) for p in program.bundle.plans.values()),
                   "kept": len(kept_ids(program.bundle.plans["forward"])) if program.bundle.plans else 0,
                   "all_reduces": getattr(program.runtime, "all_reduces", 0),
                   "planned_all_reduces": planned_all_reduces(program.bundle.graphs, program.runtime.plan),
                   "replicated": len(program.runtime.plan.replicated),
                   "async_reduce": getattr(program.runtime, "issue", SIMULATOR).async_reduce}
    provenance = program.bundle.provenance
    result = {"losses": losses, "memory": memory, "plan": plan, "collectives": collectives, "norms": norms,
              "saved": (provenance.get("saved_for_backward_bytes"),
                        provenance.get("saved_for_backward_bytes_without_checkpointing")),
              "plan_digest": plan_digest(program.bundle), "reused_plan": program.reused_plan,
              "latency_ms": provenance.get("comm_latency_ms")}
    if full_state:
        result["state"] = {key: value.clone() for key, value in model.state_dict().items()}
    return result


def planned_all_reduces(graphs, plan) -> int:
    """The all-reduces one step issues under ``plan`` (a CommPlan): one per replicated parameter's reduce, one per
    reduce bucket of them."""
    from dcsched.graph.roles import Role, comm_ids, role_of
    reduces = sum(1 for graph in graphs.values() for node in graph.nodes
                  if role_of(node) is Role.REDUCE and comm_ids(node)[1] in plan.replicated)
    fused = sum(len(bucket) - 1 for comm in plan.graphs.values() for bucket in comm.reduce
                if bucket[0] in plan.replicated)
    return reduces - fused


def plan_digest(bundle) -> dict[str, str]:
    """Per graph of a scheduled bundle, a digest of what its plan decides: the node order, the buckets and the
    residency (figures left out)."""
    import hashlib
    import json
    from dcsched.runtime.consensus import _plan_data
    return {name: hashlib.sha256(json.dumps([[node.name for node in graph.nodes], _plan_data(bundle.plans.get(name))],
                                            sort_keys=True).encode()).hexdigest()[:16]
            for name, graph in bundle.graphs.items()}


def order_digest(graph) -> str:
    """A digest of a graph's node order (names), equal where two ranks run the same order."""
    import hashlib
    return hashlib.sha256(" ".join(node.name for node in graph.nodes).encode()).hexdigest()[:16]


def skew_measured_times(rank: int) -> None:
    """Make this process's measured cost model see its own timings: every node's time scaled by a factor drawn
    from [0.1, 10] with ``rank`` as the seed, as ranks on a busy machine (or unequal GPUs) measure."""
    import random

    from dcsched.costmodels.measured import Timer
    measure, draw = Timer.time, random.Random(1000 + rank)

    def skewed(self, call, iters, warmup):
        out, ms = measure(self, call, iters, warmup)
        return out, ms * draw.uniform(0.1, 10.0)

    Timer.time = skewed


def train_eager(name: str, steps: int, batch: int, split: int = 1, device: str = "cpu", **overrides) -> list[float]:
    """Single-process eager training on the global batches; ``split`` > 1 averages the losses of that many slices."""
    model, _ = model_of(name, device, **overrides)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for inputs in global_batches(name, steps, batch, **overrides):
        parts = [model(*(t.to(device) for t in local_slice(inputs, r, split))) for r in range(split)]
        loss = torch.stack(parts).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def spawn(out_dir: Path, world_size: int, plan: list[tuple], skew: bool = False) -> list[dict]:
    """Run ``plan`` (see :func:`spawned_losses`) on ``world_size`` gloo ranks; each rank's results by label.

    ``skew``: each rank's measured times are its own (:func:`skew_measured_times`).
    """
    import torch.multiprocessing as mp
    out_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(spawned_losses, args=(world_size, free_port(), str(out_dir), plan, skew), nprocs=world_size, join=True)
    return [torch.load(out_dir / f"losses{rank}.pt", weights_only=True) for rank in range(world_size)]


def spawned_losses(rank: int, world_size: int, port: int, out_dir: str, runs: list[tuple], skew: bool = False) -> None:
    """mp.spawn target: each (label, name, algo, steps, batch, overrides) run; results saved per rank.

    ``name`` ``hf-<model>`` is a Hugging Face model (:func:`hf_models.train`, ``batch`` unused).

    A run whose overrides hold ``per_rank`` (rank -> more overrides) gives each rank its own; a run that raises
    a dcsched error records ``{"error": message}`` and the next run goes on.
    """
    from dcsched.runtime.distributed import shutdown
    from dcsched.errors import DcschedError
    from dcsched.profile.scripts import unwrap_dynamo_error
    init_gloo(rank, world_size, port)
    if skew:
        skew_measured_times(rank)
    try:
        results = {}
        for label, name, algo, steps, batch, overrides in runs:
            overrides = dict(overrides)
            overrides.update(overrides.pop("per_rank", {}).get(rank, {}))
            try:
                if name.startswith("hf-"):  # a Hugging Face model: every rank fed the same batches
                    import hf_models
                    results[label] = hf_models.train(name[3:], steps, algo, **overrides)
                else:
                    results[label] = train_dcsched(name, algo, steps, batch, rank, world_size, **overrides)
            except Exception as exc:  # noqa: BLE001 (TorchDynamo wraps the backend's errors)
                error = unwrap_dynamo_error(exc)
                if not isinstance(error, DcschedError):
                    raise
                results[label] = {"error": str(error)}
        torch.save(results, Path(out_dir) / f"losses{rank}.pt")
    finally:
        shutdown()
