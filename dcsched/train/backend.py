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
3. reorders both graphs with ``algo`` (``memory_budget`` for the schedulers
   that take one; by default the target device's memory less 10%, unlimited
   where none is known);
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
import functools

import torch

from dcsched import schedulers
from dcsched.budget import Budget, check_scope, default_budget
from dcsched.profile.capture import capture_compiled
from dcsched.runtime.consensus import check_same, plan_fingerprints
from dcsched.errors import DcschedError
from dcsched.profile.measure import ProfileOptions, profile_bundle
from dcsched.schedulers.reorder import schedule
from dcsched.train.program import ScheduledProgram
from dcsched.train.full_state import any_sharded
from dcsched.train.sharding import ShardingError, sharding_for_inputs


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """How :func:`backend` schedules and runs: the algorithm, its memory budget (bytes or '40GiB'), the cost
    model, and how the scheduled graphs run (``compute``: ``eager`` or ``inductor``)."""

    algo: str = "none"
    memory_budget: float | int | str | None = None
    budget_scope: str | None = None
    cost_model: str = "measured"
    gpu: str | None = None
    iters: int = 1
    warmup: int = 1
    compute: str = "eager"

    def check(self) -> None:
        """Raise :class:`DcschedError` (one line) for options no compile can use, before anything runs."""
        accepted = schedulers.get(self.algo).options  # raises for an unknown name
        from dcsched.train.inductor import COMPUTE_MODES
        if self.compute not in COMPUTE_MODES:
            raise DcschedError(f"unknown compute {self.compute!r}: choose one of {', '.join(COMPUTE_MODES)}")
        if self.given_budget is not None:
            if "memory_budget" not in accepted:
                raise DcschedError(f"scheduler '{self.algo}' takes no memory budget")
        if self.budget_scope is not None:
            check_scope(self.budget_scope)
            if "budget_scope" not in accepted:
                raise DcschedError(f"scheduler '{self.algo}' takes no budget scope")
        self.profile_options(1).check()

    def profile_options(self, world_size: int) -> ProfileOptions:
        return ProfileOptions(cost_model=self.cost_model, iters=self.iters, warmup=self.warmup,
                              world_size=world_size, gpu=self.gpu, progress=False)

    def budget(self, bundle) -> Budget | None:
        """The budget to schedule ``bundle`` with: the one given, else the one default rule's
        (:func:`dcsched.budget.default_budget`: the target device's memory recorded in the bundle less 10%,
        else no limit); None for a scheduler that takes none.

        Parameters
        ----------
        bundle : Bundle
            The profiled bundle (its provenance may record the device's memory).

        Returns
        -------
        Budget or None

        Raises
        ------
        DcschedError
            When a budget was given to a scheduler that takes none.
        OptionError
            For an unreadable budget or scope.
        """
        if not schedulers.get(self.algo).takes_budget:
            if self.memory_budget is not None:
                raise DcschedError(f"scheduler '{self.algo}' takes no memory budget")
            return None
        given = self.given_budget
        return given if given is not None else default_budget(bundle, scope=self.budget_scope)

    @functools.cached_property
    def given_budget(self) -> Budget | None:
        """The budget given as ``memory_budget`` (bytes, '40GiB', 'unlimited'), read once; None when none was.

        Raises
        ------
        OptionError
            For a value that is not a budget, or an unknown ``budget_scope``.
        """
        return None if self.memory_budget is None else Budget.parse(self.memory_budget, scope=self.budget_scope)


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


def backend(algo: str = "none", memory_budget: float | int | str | None = None, **options) -> Backend:
    """A TorchDynamo backend training with scheduler ``algo``; ``options``: the rest of :class:`TrainOptions`."""
    return Backend(TrainOptions(algo=algo, memory_budget=memory_budget, **options))


def _rng_devices(sharding) -> list:
    device = sharding.specs[0].param.device
    return [device] if device.type == "cuda" else []


def compile_program(gm: torch.fx.GraphModule, example_inputs, sharding, options: TrainOptions) -> ScheduledProgram:
    """Capture, profile and schedule ``gm`` (a TorchDynamo graph of the sharded module) into a program."""
    from dcsched.replay.simulated import simulated_figures

    with torch.random.fork_rng(devices=_rng_devices(sharding)):
        captured = capture_compiled(gm, example_inputs, sharding.module,
                                    [(spec.name, spec.stand_in) for spec in sharding.specs])
        profiled = profile_bundle(captured.bundle, options.profile_options(sharding.world_size),
                                  inputs=captured.inputs)
    budget = options.budget(profiled)
    scheduled = profiled.with_graphs(forward=schedule(profiled.forward, options.algo, budget=budget),
                                     backward=schedule(profiled.backward, options.algo, budget=budget))
    scheduled.provenance["algo"] = options.algo
    # Agreed figures make equal plans; checked anyway before the first step's collectives, since a plan that
    # differed would pair one rank's gathers with another's parameters.
    check_same(plan_fingerprints(scheduled), "scheduled", group=sharding.group)
    figures, _note = simulated_figures(scheduled)
    return ScheduledProgram(sharding, scheduled, profiled, captured.mutated_inputs, options.algo, figures,
                            compute=options.compute)
