"""``dcsched train``'s core: run a user's training script with every compiled module trained by dcsched.

:func:`train_script` runs the script as ``__main__`` (:mod:`dcsched.profile.scripts`)
with ``torch.compile`` intercepted. At each ``torch.compile(model, ...)``
call it shards the module (:func:`dcsched.shard`, in place: an optimizer
built before or after sees the shards) and compiles it for real with
``backend=dcsched.backend(...)`` and ``dynamic=False``; the script's own
loop, optimizer and loss stay as they are. Under torchrun it joins the
process group first (gloo on the CPU, NCCL on CUDA) and watches the other
ranks (:mod:`dcsched.train.failures`).

With ``measure`` each compiled graph's first step has its peak memory
tracked and every later one is timed
(:class:`~dcsched.train.program.ScheduledProgram`), and
:class:`TrainResult` sets those figures beside the simulator's for the
schedule. The per-step losses are the compiled forward's first output where
that is a 0-d tensor (a script whose module returns its loss).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import statistics
import weakref
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

import torch

from dcsched.bundle import saved_memory
from dcsched.errors import DcschedError
from dcsched.profile.checkpointing import tracing_checkpoints
from dcsched.profile.scripts import compile_interceptor, describe_exception, run_script
from dcsched.train import agreement, hf_trainer, stored_plan
from dcsched.train.backend import Backend
from dcsched.train.mixed_precision import from_names
from dcsched.train.options import ScriptOptions, TrainOptions
from dcsched.train.program import ScheduledProgram
from dcsched.train.sharding import shard

# Loaded before the ranks start watching each other (_join): scripts checkpoint through it, and its imports
# (torch's DTensor and distributed checkpoint, sympy) would otherwise load during the first compile, where on a
# busy machine they delay this rank's heartbeats by seconds.
from dcsched.train import checkpoint  # noqa: F401,E402


class TrainError(DcschedError):
    """The script cannot be trained with dcsched as it is (exit code 2); the message says what to change."""


class ScriptFailed(DcschedError):
    """The training script itself raised (exit code 1)."""

    exit_code = 1


@dataclasses.dataclass
class GraphFigures:
    """One compiled graph's measured figures (median step time, highest peak) beside the simulator's."""

    module: str
    graph: str
    steps: int
    #: Steps timed (all but the first, which tracks memory: the tracker slows a step down).
    timed_steps: int
    measured_ms: float | None
    simulated_ms: float | None
    measured_peak_bytes: int | None
    simulated_peak_bytes: int | None


@dataclasses.dataclass
class TrainResult:
    """What a training run did on this rank."""

    script: str
    algo: str
    rank: int
    world_size: int
    exit_code: int
    modules: list[str]
    graphs: list[GraphFigures]
    losses: list[float] | None
    #: Why the simulated step times are only a rough guide (costs measured on the CPU), or None.
    caveat: str | None = None
    compute: str = "eager"
    #: Per compiled module (its label in ``graphs``): what its step saves for the backward, with and without
    #: its checkpointing (:meth:`dcsched.bundle.saved_memory.SavedActivations.to_json`).
    activation_memory: dict[str, dict] = dataclasses.field(default_factory=dict)
    #: With ``--plan FILE``: ``{"path": FILE, "reused": bool}``, whether the plan came from FILE or was stored there.
    plan_file: dict | None = None
    #: With ``measure``: per compiled module (its label), the whole step's simulated memory per rank by kind
    #: (:class:`dcsched.sim.step_memory.StepMemory`, under its plans, with the script's optimizer).
    step_memory: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        out = {"script": self.script, "algo": self.algo, "compute": self.compute, "world_size": self.world_size,
               "exit_code": self.exit_code,
               "modules": self.modules, "graphs": [dataclasses.asdict(g) for g in self.graphs]}
        if self.caveat:
            out["caveat"] = self.caveat
        if self.losses is not None:
            out["losses"] = self.losses
        if self.activation_memory:
            out["activation_memory"] = self.activation_memory
        if self.plan_file is not None:
            out["plan_file"] = self.plan_file
        if self.step_memory:
            out["step_memory"] = {label: memory.to_json() for label, memory in self.step_memory.items()}
        return out


class _RecordingBackend(Backend):
    """``dcsched.backend`` that, on request, measures and keeps the losses; it brackets each compile."""

    def __init__(self, options: TrainOptions, name: str, measure: bool,
                 compiling: Callable[[str], ContextManager]) -> None:
        super().__init__(options)
        self.name, self.measure, self.compiling = name, measure, compiling
        self.losses: list[torch.Tensor] = []
        #: With ``measure``: per program, the optimizer the script built over its module's parameters (found at
        #: its first step; None: none dcsched models), for its whole-step memory.
        self.optimizers: dict[int, Any] = {}

    def __call__(self, gm, example_inputs):
        with self.compiling(f"{self.name} ({len(self.programs) + 1}): capture, profile, schedule "
                            f"({self.options.algo})"):
            program = super().__call__(gm, example_inputs)
        if not isinstance(program, ScheduledProgram):  # a piece after a graph break that reads no parameter
            return program
        program.measure = self.measure
        program.compiling = lambda what: self.compiling(f"{self.name}'s {what}")

        def step(*args):
            # Memory on the first step, time alone on the others (the memory tracker slows a step down).
            program.track_memory = program.compute == "eager" and not program.stats
            if self.measure and id(program) not in self.optimizers:
                from dcsched.profile.capture import optimizer_over
                self.optimizers[id(program)] = optimizer_over(program.sharding.module.parameters())
            return program(*args)

        return step

    def record_loss(self, _module, _args, output) -> None:
        """A forward hook on the compiled module: its loss, where it returns one, in a training step.

        Only for a report: kept unasked, every step's loss tensor would stay alive for the whole run.
        """
        loss = _loss_of(output)
        if self.measure and loss is not None and torch.is_grad_enabled():
            self.losses.append(loss.detach())


def _loss_of(output) -> torch.Tensor | None:
    """A module's loss: its 0-d output, a mapping's ``loss`` (Hugging Face's outputs), a tuple's first."""
    if isinstance(output, dict) or hasattr(output, "loss"):
        output = output.get("loss") if isinstance(output, dict) else output.loss
    elif isinstance(output, (tuple, list)) and output:
        output = output[0]
    if isinstance(output, torch.Tensor) and output.dim() == 0 and output.is_floating_point():
        return output
    return None


class _Interceptor:
    """Stands in for ``torch.compile`` while the script runs: shard, then compile with a dcsched backend."""

    def __init__(self, options: ScriptOptions, real_compile, compiling: Callable[[str], ContextManager]) -> None:
        self.options, self.real_compile, self.compiling = options, real_compile, compiling
        self.backends: list[_RecordingBackend] = []
        self.sharded: dict[int, str] = {}  # id(parameter) -> its name
        self._checked: weakref.WeakSet = weakref.WeakSet()
        self.compile = compile_interceptor(self.compile_module, TrainError,
                                           "dcsched train shards and trains compiled modules")

    def compile_module(self, model, module, kwargs: dict):
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            # Hugging Face's Trainer (accelerate) wraps the model in DDP before compiling it. dcsched shards and
            # reduce-scatters the gradients itself, so the inner module is compiled and DDP's forward never runs:
            # its reducer then never expects a gradient, and its all-reduce hooks stay idle.
            model = module = module.module
        options = self.options
        sharding = shard(module, replicate_below=options.replicate_below,
                         mp_policy=from_names(options.param_dtype, options.reduce_dtype, options.output_dtype))
        self.sharded.update({id(spec.param): spec.name for spec in sharding.specs})
        backend = _RecordingBackend(self.options.train, type(module).__name__, self.options.measure, self.compiling)
        self.backends.append(backend)
        if sharding.world_size > 1:  # a Trainer the script loaded saves by gathering on every rank
            hf_trainer.patch_loaded_trainer()
        compiled = self.real_compile(model, backend=backend, dynamic=False, fullgraph=bool(kwargs.get("fullgraph")))
        if isinstance(compiled, torch.nn.Module):
            compiled.register_forward_hook(backend.record_loss)
        return compiled

    def before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """A global optimizer pre-step hook: refuse state of full size for a sharded parameter (it stepped before)."""
        if optimizer in self._checked or not self.sharded:
            return
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in self.sharded:
                    continue
                self._checked.add(optimizer)  # its first step over shards: later state is of shard size
                for key, value in optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                        raise TrainError(
                            f"{type(optimizer).__name__} stepped before torch.compile: its state {key!r} of "
                            f"{self.sharded[id(param)]} is full size {tuple(value.shape)}, the parameter is now "
                            f"a shard {tuple(param.shape)}; call torch.compile(model) before the optimizer's "
                            "first step")


def _no_phase(name: str) -> ContextManager:
    return contextlib.nullcontext()


def train_script(path: str | os.PathLike, argv: Sequence[str] = (), options: ScriptOptions = ScriptOptions(),
                 compiling: Callable[[str], ContextManager] = _no_phase) -> TrainResult:
    """Run ``path`` with ``argv``, every compiled module trained by dcsched; see the module docstring.

    ``compiling(name)`` brackets each compile (a progress display). Raises
    :class:`TrainError` (bad options, a script that never compiles a module,
    an optimizer that stepped before the compile) and :class:`ScriptFailed`
    (the script raised).
    """
    from dcsched.runtime import distributed
    path = Path(path)
    options.check()
    if not path.is_file():
        raise TrainError(f"{path}: no such script")
    watch = _join(options.timeout_s)
    rank, world_size = _rank_and_size()
    if watch is not None:
        compiling = _meeting_after(compiling, watch)
    interceptor = _Interceptor(options, torch.compile, compiling)
    stored_plan.forget_claims()  # a run's first compile claims its --plan file anew
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    hook = register_optimizer_step_pre_hook(interceptor.before_optimizer_step)
    try:
        with hf_trainer.saving_on_every_rank(), tracing_checkpoints():
            run = run_script(path, argv, interceptor.compile)
    except BaseException as exc:
        message = str(exc) if isinstance(exc, DcschedError) else describe_exception(exc)
        if watch is not None:
            watch.failed(f"raised: {message}")
        distributed.shutdown(together=False)
        if isinstance(exc, DcschedError) or not isinstance(exc, Exception):
            raise
        raise ScriptFailed(f"{path} failed: {message}") from None
    finally:
        hook.remove()
    if watch is not None:
        if run.exit_code != 0:
            watch.failed(f"exited with status {run.exit_code}")
        else:
            watch.finish()
    distributed.shutdown(together=run.exit_code == 0)
    if not interceptor.backends and run.exit_code == 0:
        raise TrainError(f"{path} never calls torch.compile, so dcsched trained nothing (the script ran on its "
                         "own): wrap the model, e.g. `model = torch.compile(model)`, before the training loop "
                         "(dcsched train intercepts that call)")
    return _result(path, options, interceptor.backends, run.exit_code, rank, world_size)


def _join(timeout_s: float):
    """Under torchrun, join the process group with ``timeout_s`` and start watching the peers; None alone."""
    from dcsched.runtime import distributed
    if not distributed.launched():
        return None
    import torch.distributed as dist
    from dcsched.train.failures import Watch
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    timeout = datetime.timedelta(seconds=timeout_s)
    # The ranks start at different times: joining may take longer than a collective may.
    joining = datetime.timedelta(seconds=max(timeout_s, 300.0))
    store, rank, world_size = next(dist.rendezvous("env://", timeout=joining))
    store.set_timeout(joining)
    distributed.init(device_type, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return Watch(store, rank, world_size, timeout_s).start()


def _rank_and_size() -> tuple[int, int]:
    """This rank and the group's size, for the :class:`TrainResult` alone (figures take the sharding's)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _meeting_after(compiling: Callable[[str], ContextManager], watch) -> Callable[[str], ContextManager]:
    """``compiling`` followed by a meeting of all ranks: the first collective after a compile waits for no one."""
    met = [0]

    @contextlib.contextmanager
    def phase(name: str):
        with compiling(name):
            yield
        # A compile that ran without the other ranks (its shapes were its own: dcsched.train.agreement) is not
        # met; the others are counted alike on every rank, so each meeting pairs up.
        if not agreement.compiled_alone():
            met[0] += 1
            watch.meet(f"compile {met[0]}")

    return phase


def _result(path: Path, options: ScriptOptions, backends: list[_RecordingBackend], exit_code: int,
            rank: int, world_size: int) -> TrainResult:
    graphs: list[GraphFigures] = []
    activation_memory: dict[str, dict] = {}
    step_memory: dict[str, Any] = {}
    for backend in backends:
        for k, program in enumerate(backend.programs):
            label = backend.name if len(backend.programs) == 1 else f"{backend.name} ({k + 1})"
            graphs.extend(_figures(label, program))
            saved = saved_memory.from_provenance(program.bundle.provenance)
            if saved is not None:
                activation_memory[label] = saved.to_json()
            if options.measure:
                step_memory[label] = _step_memory(program, backend.optimizers.get(id(program)))
    from dcsched.sim.bundle_figures import timing_caveat
    losses = next(([float(v) for v in b.losses] for b in backends if b.losses), None)
    programs = [p for b in backends for p in b.programs]
    caveat = timing_caveat(programs[0].bundle.provenance) if programs else None
    if programs and options.train.cost_model != "measured":
        caveat = (f"simulated step times are the {options.train.cost_model} cost model's for "
                  f"{options.train.gpu or 'the target'}, measured ones are on {programs[0].device}")
    plan_file = None if options.train.plan is None else {
        "path": str(options.train.plan), "reused": any(getattr(p, "reused_plan", False) for p in programs)}
    return TrainResult(str(path), options.train.algo, rank, world_size, exit_code,
                       [b.name for b in backends], graphs, losses, caveat, options.train.compute,
                       activation_memory, plan_file, {k: v for k, v in step_memory.items() if v is not None})


def _step_memory(program, optimizer) -> Any:
    """The program's whole-step memory per rank under its plans (:func:`dcsched.sim.step_memory.step_memory`),
    with the script's optimizer; None where its graphs do not simulate."""
    from dcsched.collective_issue import SIMULATOR
    from dcsched.errors import DcschedError
    from dcsched.sim.step_memory import step_memory
    # as the per-graph figures: the backward's way without gloo's copies (what the memory tracker sees); one
    # process issues nothing in flight
    issue = getattr(program.runtime, "issue", None)
    issue = issue.without_staging() if issue is not None and program.sharding.world_size > 1 else SIMULATOR
    try:
        return step_memory(program.bundle, optimizer, issue=issue)
    except DcschedError:
        return None


def _figures(label: str, program) -> list[GraphFigures]:
    simulated = program.simulated or {}
    out = []
    for graph in ("forward", "backward"):
        stats = [getattr(s, graph) for s in program.stats if getattr(s, graph) is not None]
        # The first step is the memory-tracked one (eager) or the one inductor compiled in: not timed.
        timed = [s.ms for s in stats[1:] if s.peak_bytes is None]
        out.append(GraphFigures(
            module=label, graph=graph, steps=len(stats), timed_steps=len(timed),
            measured_ms=statistics.median(timed) if timed else None,
            simulated_ms=simulated.get(f"{graph}_ms"),
            measured_peak_bytes=max((s.peak_bytes for s in stats if s.peak_bytes is not None), default=None),
            simulated_peak_bytes=simulated.get(f"{graph}_peak_bytes")))
    return out
