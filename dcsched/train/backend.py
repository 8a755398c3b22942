"""``dcsched.backend``: a TorchDynamo backend that trains a sharded module with a dcsched schedule.

>>> import torch, dcsched
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
>>> _ = dcsched.shard(model)                       # before the optimizer steps: it sees the shards
>>> optimizer = torch.optim.AdamW(model.parameters())
>>> compiled = torch.compile(model, backend=dcsched.backend(algo="fast-free"), dynamic=False)
>>> loss = compiled(torch.randn(2, 4)).sum()
>>> loss.backward(); optimizer.step()
>>> [tuple(p.grad.shape) for p in model.parameters()]
[(32,), (8,), (8,), (1,)]

On its first call TorchDynamo traces the module (with the full-size
stand-ins :func:`dcsched.shard` installed) and calls the backend, which:

1. captures the forward and backward aten graphs through AOT autograd
   (:func:`dcsched.profile.capture.capture_compiled`) and inserts the ZeRO-3 ops;
2. profiles them (``cost_model``: ``measured`` runs each node once here,
   ``analytic`` estimates them for ``gpu``) so the schedulers have costs;
3. reorders both graphs with ``algo`` (default ``overlap-plan``;
   ``memory_budget`` for the schedulers that take one: by default the target
   device's memory less 10%, where none is known FSDP2's peak for a step
   planner and unlimited for the others); the parameters ``dcsched.shard(...,
   replicate_below=N)`` left whole become ``'replicated'`` in every plan,
   whatever the scheduler said of them;
4. returns a :class:`~dcsched.train.program.ScheduledProgram`, which runs
   every later step: the scheduled graphs' aten ops one by one
   (``compute="eager"``, what the simulator models) or compiled by inductor
   with the ZeRO-3 ops kept in place (``compute="inductor"``,
   :mod:`dcsched.train.inductor`).

The global random state is left as it was, so training draws the same
random numbers as it would without the compile.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from dcsched.budget import Budget
from dcsched.collective_issue import GLOO, PROCESS_GROUP, SIMULATOR, CollectiveIssue
from dcsched.profile.capture import capture_compiled
from dcsched.runtime.consensus import check_same, plan_fingerprints
from dcsched.profile.measure import profile_bundle, profile_topology
from dcsched.schedulers import run_step
from dcsched.sim.collectives import latency_from_provenance
from dcsched.train import agreement
from dcsched.train.program import ScheduledProgram
from dcsched.train.full_state import any_sharded
from dcsched.train.mixed_precision import carry_dtypes
from dcsched.train.options import DEFAULT_ALGO, TrainOptions
from dcsched.train import stored_plan
from dcsched.profile.steady import steady_figures
from dcsched.bundle.core import Bundle
from dcsched.train.sharding import ShardingError, sharding_for_inputs


class Backend:
    """The TorchDynamo backend :func:`backend` returns; ``programs`` lists what it compiled, in order."""

    def __init__(self, options: TrainOptions) -> None:
        options.check()
        self.options = options
        self.programs: list[ScheduledProgram] = []

    def __repr__(self) -> str:
        return f"dcsched.backend(algo={self.options.algo!r})"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        sharding = sharding_for_inputs(example_inputs)
        if sharding is None:
            return _without_parameters(gm, example_inputs)
        _refuse_unsharded(sharding, example_inputs)
        # A call without gradients (evaluation under no_grad or inference_mode) compiles the same training step
        # (captured with gradients on); run without gradients, its forward alone runs, gathers and releases
        # included, and nothing is kept for a backward.
        with torch.inference_mode(False), torch.enable_grad():
            program = compile_program(gm, example_inputs, sharding, self.options)
        self.programs.append(program)
        return program


def _without_parameters(gm: torch.fx.GraphModule, example_inputs):
    """A graph that reads no sharded parameter: a piece of a sharded module's forward after a graph break
    (the loss computed from the logits, say) runs as TorchDynamo traced it, eagerly.

    A graph that takes trainable parameters dcsched did not shard is refused: its gradients would not be
    averaged across the ranks.
    """
    trainable = [value for value in example_inputs if isinstance(value, torch.nn.Parameter) and value.requires_grad]
    if trainable or not any_sharded():
        raise ShardingError("the compiled module is not sharded: call dcsched.shard(model) before "
                            "torch.compile(model, backend=dcsched.backend(...))")
    return gm.forward


def _refuse_unsharded(sharding, example_inputs) -> None:
    """Refuse a graph that takes a trainable parameter :func:`dcsched.shard` did not shard (one added to the
    module after it, or another module's): its gradient would be this rank's alone, never averaged."""
    sharded = {id(spec.param) for spec in sharding.specs}
    for value in example_inputs:
        if isinstance(value, torch.nn.Parameter) and value.requires_grad and id(value) not in sharded:
            names = [name for name, p in sharding.module.named_parameters() if p is value]
            what = f"{type(sharding.module).__name__}.{names[0]}" if names else \
                f"a trainable parameter of shape {tuple(value.shape)} from outside {type(sharding.module).__name__}"
            raise ShardingError(f"{what} is not sharded by dcsched.shard, so its gradient would not be averaged "
                                "across the ranks: add parameters before dcsched.shard (before torch.compile), or "
                                "freeze it (requires_grad=False)")


def backend(algo: str = DEFAULT_ALGO, memory_budget: float | int | str | None = None, **options) -> Backend:
    """A TorchDynamo backend training a :func:`dcsched.shard`-ed module with scheduler ``algo``.

    Parameters
    ----------
    algo : str
        The scheduler for both graphs of every compile, a name from :func:`dcsched.schedulers.available`;
        default ``overlap-plan``, the step planner.
    memory_budget : float or int or str, optional
        For the schedulers that take one: bytes, a size (``'40GiB'``), ``'unlimited'`` or ``'fsdp'``; by
        default the target device's memory less 10%, where none is known (the CPU) ``'fsdp'`` for
        ``overlap-plan``.
    **options
        The rest of :class:`~dcsched.train.options.TrainOptions`: ``budget_scope``, ``algo_options``
        (``{"k": 2}``), ``cost_model``, ``gpu``, ``iters``, ``warmup``, ``bandwidth_gbps``, ``latency_us``
        (the modelled collectives' figures; default the interconnect table's), ``compute``.

    Returns
    -------
    Backend
        Pass it as ``torch.compile(model, backend=...)``; its ``programs`` lists what it compiled.

    Raises
    ------
    OptionError
        An option no compile can use (:meth:`TrainOptions.check <dcsched.train.options.TrainOptions.check>`),
        raised here rather than at the first step.
    TypeError
        A keyword that is not a :class:`~dcsched.train.options.TrainOptions` field.

    Examples
    --------
    >>> import dcsched
    >>> dcsched.backend(algo="prefetch-ahead", algo_options={"k": 2})
    dcsched.backend(algo='prefetch-ahead')
    """
    return Backend(TrainOptions(algo=algo, memory_budget=memory_budget, **options))


def _device(sharding) -> torch.device:
    """The device the sharded module's parameters (and the step) are on."""
    return sharding.specs[0].param.device


def _rng_devices(sharding) -> list:
    device = _device(sharding)
    return [device] if device.type == "cuda" else []


def fastest_issue(sharding) -> CollectiveIssue:
    """The fastest way the step's process group issues its collectives: :data:`~dcsched.collective_issue.GLOO`
    on gloo (which stages them through flat copies of its own, :mod:`dcsched.sim.staging`), else
    :data:`~dcsched.collective_issue.PROCESS_GROUP`."""
    if sharding.world_size < 2:
        return PROCESS_GROUP
    import torch.distributed as dist

    return GLOO if dist.is_initialized() and dist.get_backend(sharding.group) == "gloo" else PROCESS_GROUP


def issue_ways(fastest: CollectiveIssue) -> tuple[CollectiveIssue, ...]:
    """The ways a step may issue its collectives, in the order tried under a finite budget: ``fastest``; its
    all-gathers blocking (gloo's staging copy of one is then gone before the compute goes on: tried only where
    ``fastest`` counts the copies, elsewhere blocking saves nothing); its reduce-scatters blocking; both.

    >>> [(way.async_gather, way.async_reduce) for way in issue_ways(PROCESS_GROUP)]
    [(True, True), (True, False)]
    >>> len(issue_ways(GLOO))
    4
    """
    ways = (fastest, dataclasses.replace(fastest, async_gather=False), dataclasses.replace(fastest, async_reduce=False),
            dataclasses.replace(fastest, async_gather=False, async_reduce=False))
    return tuple(dict.fromkeys(way for way in ways if fastest.staging or way.async_gather))


def asynchrony(budget: Budget | None, scheduled, *, fastest: CollectiveIssue) -> dict[str, CollectiveIssue]:
    """Per graph of ``scheduled``, how its collectives are issued: ``{name: issue}``.

    Asynchronous, a reduce-scatter keeps its gradient until the next one is issued, and on gloo
    (``fastest.staging``) each collective's own flat copy lives beside the compute while it runs; the
    schedulers plan within a budget without either. A budget is a promise (for each graph's peak), so under a
    finite one each graph takes the first of :func:`issue_ways` of ``fastest`` that the simulator, run that
    way, keeps it within, and the last tried where none does. Without a budget, ``fastest`` everywhere.
    """
    if budget is None or not math.isfinite(budget.bytes):
        return {name: fastest for name in scheduled.graph_names}
    from dcsched.sim.bundle_figures import simulate_graph

    ways = issue_ways(fastest)
    chosen = {}
    for name in scheduled.graph_names:
        for way in ways:
            if simulate_graph(scheduled, name, issue=way).peak_in(budget.scope) <= budget.bytes:
                break
        chosen[name] = way
    return chosen


def _traced_stand_ins(sharding, example_inputs) -> list[tuple[str, torch.Tensor]]:
    """Each parameter's stand-in as the graph takes it (the one requiring grad or the frozen one), by ds_id."""
    present = {id(value) for value in example_inputs if isinstance(value, torch.Tensor)}
    return [(spec.name, next((s for s in spec.stand_ins if id(s) in present), spec.stand_in))
            for spec in sharding.specs]


def compile_program(gm: torch.fx.GraphModule, example_inputs, sharding, options: TrainOptions) -> ScheduledProgram:
    """Capture, profile and schedule ``gm`` (a TorchDynamo graph of the sharded module) into a program; with
    ``options.plan``, reuse the plan stored there for this step, or store the one made here
    (:mod:`dcsched.train.stored_plan`)."""
    from dcsched.sim.bundle_figures import simulated_figures

    fastest = fastest_issue(sharding)
    with torch.random.fork_rng(devices=_rng_devices(sharding)):
        captured = capture_compiled(gm, example_inputs, sharding.module,
                                    _traced_stand_ins(sharding, example_inputs))
        carry_dtypes(captured.bundle, sharding.specs)  # mp_policy: shards, gathers and reduces in their dtypes
        # Before any collective of the compile: whether every rank compiles this step with these shapes.
        captured_digest = agreement.captured_collectives(captured.bundle)
        decision = agreement.announce(sharding, example_inputs, compiling=True, plan=0, captured=captured_digest,
                                      what=type(sharding.module).__name__)
        agreement.mark_compiled_alone(decision != "planned")
        if decision != "planned":
            return _as_captured(sharding, captured, captured_digest, options, decision)
        plan_file = options.plan
        key = _plan_key(captured.bundle, sharding, options) if plan_file is not None else None
        stored = None if plan_file is None or key is None else stored_plan.read(plan_file, key, group=sharding.group)
        if stored is not None and plan_file is not None:  # this very step's stored plan: nothing to profile or plan
            scheduled, ways = stored_plan.reused(captured.bundle, stored, sharding.world_size, fastest, plan_file)
        else:
            scheduled, ways = _profile_and_plan(captured, sharding, options, fastest)
    # Agreed figures make equal plans; checked anyway before the first step's collectives, since a plan that
    # differed would pair one rank's gathers with another's parameters.
    fingerprints = plan_fingerprints(scheduled)
    check_same(fingerprints, "scheduled", group=sharding.group)
    if plan_file is not None and key is not None and stored is None and stored_plan.may_write(plan_file):
        stored_plan.write(plan_file, scheduled, key, ways, rank=_rank(sharding))
    # the reduce-scatters are the backward's: its way is the figures' (as the per-rank memory tracker sees it,
    # without gloo's copies; nothing in flight without a peer) and the default of any other graph
    issue = ways.get("backward", fastest)
    figures, _note = simulated_figures(scheduled, issue=issue.without_staging() if sharding.world_size > 1
                                       else SIMULATOR)
    program = ScheduledProgram(sharding, scheduled, captured.bundle, captured.mutated_inputs, options.algo, figures,
                               compute=options.compute, issue=issue, issues=ways)
    program.plan_digest = agreement.digest(b"".join(name.encode() + b"\0" + value
                                                    for name, value in sorted(fingerprints.items())))
    program.captured_digest, program.pending = captured_digest, decision
    program.reused_plan = stored is not None
    return program


def _profile_and_plan(captured, sharding, options: TrainOptions,
                      fastest: CollectiveIssue) -> tuple[Bundle, dict[str, CollectiveIssue]]:
    """The captured step profiled (its figures made steady: :func:`dcsched.profile.steady.steady_figures`) and
    scheduled with ``options.algo``, and how each graph issues its collectives (:func:`asynchrony`)."""
    # The world size is the sharding's (its group cut the shards), alone too: the topology is resolved from it.
    profile_options = options.profile_options(sharding.world_size)
    topology = profile_topology(profile_options, group_size=sharding.world_size)
    profiled = profile_bundle(captured.bundle, profile_options, inputs=captured.inputs, topology=topology)
    # the same on every rank already (the maximum over them); now steady from run to run
    steady_figures(profiled, topology=topology)
    budget = options.budget(profiled, issue=fastest)
    # Both graphs at once: a step scheduler plans them together (what it keeps gathered spans the two).
    plans = run_step(options.scheduler, {name: profiled.form(name) for name in profiled.graph_names}, budget=budget,
                     comm_latency_ms=latency_from_provenance(profiled.provenance),
                     **options.scheduler_options(_device(sharding).type, issue=fastest))
    if sharding.replicated:  # whole on every rank since dcsched.shard: the plans must not gather them
        plans = {name: plan.replicating(sharding.replicated) for name, plan in plans.items()}
    scheduled = profiled.reordered({name: list(plan.order) for name, plan in plans.items()}, plans=plans)
    scheduled.provenance["algo"] = options.algo
    return scheduled, asynchrony(budget, scheduled, fastest=fastest)


def _plan_key(captured: Bundle, sharding, options: TrainOptions) -> dict:
    """What a stored plan must have been made for to be reused here (:func:`dcsched.train.stored_plan.plan_key`):
    the step, the world size, the scheduler and every option that changes its plan."""
    budget = options.memory_budget
    return stored_plan.plan_key(captured, world_size=sharding.world_size, algo=options.algo, options={
        "memory_budget": budget if budget is None or isinstance(budget, (int, float)) else str(budget),
        "budget_scope": options.budget_scope,
        "algo_options": {name: options.algo_options[name] for name in sorted(options.algo_options)},
        "cost_model": options.cost_model, "gpu": options.gpu, "bandwidth_gbps": options.bandwidth_gbps,
        "latency_us": options.latency_us, "replicated": sorted(sharding.replicated)})


def _rank(sharding) -> int:
    """This process's rank in the sharding's group; 0 alone."""
    if sharding.world_size < 2:
        return 0
    import torch.distributed as dist

    return dist.get_rank(sharding.group)


def _as_captured(sharding, captured, captured_digest: int, options: TrainOptions, decision: str) -> ScheduledProgram:
    """The step as captured, one collective per parameter in the captured order, not profiled or planned: what a
    rank compiling while others do not (or with other shapes) runs, the others running their steps alike
    (:mod:`dcsched.train.agreement`)."""
    program = ScheduledProgram(sharding, captured.bundle, captured.bundle, captured.mutated_inputs, "none",
                               compute=options.compute)
    program.captured_digest, program.pending = captured_digest, decision
    return program
