"""Running a scheduled step in training: an autograd Function around the scheduled forward and backward graphs.

:class:`ScheduledProgram` is what :func:`dcsched.backend` hands TorchDynamo
for a compiled module. Each call:

1. puts the module's parameter shards (``dcsched.shard``) where the traced
   graph takes the full-size stand-ins;
2. runs :class:`_ScheduledStep`, an ``autograd.Function`` whose forward runs
   the scheduled forward graph (through :mod:`dcsched.runtime.step`) and keeps the
   tensors the backward reads, and whose backward runs the scheduled backward
   graph with autograd's incoming gradients as tangents, freeing each saved
   tensor after its last use. Its gradients for the shards are the
   reduce-scattered (averaged) local gradient shards, which autograd
   accumulates into each shard's ``.grad``;
3. copies the new values of mutated inputs (BatchNorm's running statistics)
   back into them.

The ZeRO-3 ops run on this program's runtime: a
:class:`~dcsched.runtime.distributed.DistributedZero3Runtime` under a process group
(all-gathers started asynchronously at their node, waited at the wait node,
freed at the last release, gradients reduce-scattered with AVG, asynchronously
on NCCL and gloo alike (:data:`~dcsched.collective_issue.PROCESS_GROUP`), one in flight, the last
waited on at the end of the backward graph; on CUDA the collectives run on
NCCL's streams), else a
:class:`~dcsched.runtime.local.LocalZero3Runtime` (world size 1: the shard is
the whole flattened parameter); :func:`dcsched.runtime.select.runtime_for`
picks. The runtime runs the scheduled bundle's communication plan
(``bundle.plans``): one collective per bucket, kept parameters held from the
forward to the backward instead of gathered twice; the runtime's ``issued``
counts each graph's collectives of the latest step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch

from dcsched.collective_issue import PROCESS_GROUP, CollectiveIssue
from dcsched.runtime.select import runtime_for
from dcsched.bundle.core import Bundle
from dcsched.runtime.memtrack import LiveBytes
from dcsched.runtime.step import build_step, graph_placeholder_names, installed, run_backward, run_forward
from dcsched.train.sharding import Sharding


@dataclasses.dataclass
class GraphStats:
    """Measured figures of one graph run: milliseconds and (when tracked) peak live bytes."""

    ms: float
    peak_bytes: int | None = None


@dataclasses.dataclass
class StepStats:
    forward: GraphStats
    backward: GraphStats | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ScheduledProgram:
    """A compiled module's scheduled step, callable as TorchDynamo's compiled function."""

    def __init__(self, sharding: Sharding, bundle: Bundle, original: Bundle, mutated_inputs: Sequence[int],
                 algo: str, simulated: dict | None = None, compute: str = "eager",
                 issue: CollectiveIssue = PROCESS_GROUP, issues: Mapping[str, CollectiveIssue] | None = None) -> None:
        self.sharding, self.bundle, self.algo = sharding, bundle, algo
        self.simulated = simulated or {}
        device = sharding.specs[0].param.device
        order = {name: graph_placeholder_names(graph) for name, graph in original.graphs.items()}
        self.step = build_step(bundle, device, placeholder_order=order)
        self.device = device
        # Collectives issued as ``issue`` says (by default reduce-scatters overlap the rest of the backward, one in
        # flight, on NCCL and gloo alike), per graph as ``issues`` says where a budget decided it; the bundle's
        # communication plan (buckets, kept parameters) runs as planned.
        self.runtime = runtime_for(bundle.params, flat_shards=True, group=sharding.group, issue=issue,
                                   plans=bundle.plans, graph_ids=bundle.graph_ids)
        if issues and hasattr(self.runtime, "issues"):
            self.runtime.issues = {bundle.graph_ids[name]: way for name, way in issues.items()
                                   if bundle.graph_ids.get(name) is not None}
        self.compute = compute
        #: ``compiling(what)`` -> a context manager around inductor's compile of a graph (a progress display).
        self.compiling: Callable[[str], ContextManager] = lambda _graph: contextlib.nullcontext()
        if compute == "inductor":
            from dcsched.train.inductor import compile_graph
            inline: dict = getattr(self.runtime, "inline_kernels", dict)()
            orders = self.step.orders  # each compiles on its first run
            around = lambda graph: self.compiling(f"{graph} graph with inductor")  # noqa: E731 (read when compiling)
            self.step.forward = compile_graph(self.step.forward, inline, orders.get("forward"),
                                              lambda: around("forward"))
            if self.step.backward is not None:
                self.step.backward = compile_graph(self.step.backward, inline, orders.get("backward"),
                                                   lambda: around("backward"))
        self.param_at = {pos: sharding.specs[int(entry["ds_id"])]
                         for pos, entry in enumerate(bundle.forward_placeholders) if entry.get("kind") == "param"}
        # mixed precision (dcsched.shard's mp_policy): each gradient reduced in its reduce dtype
        self.runtime.reduce_dtypes = {spec.ds_id: spec.reduce_dtype for spec in sharding.specs
                                      if spec.reduce_dtype is not None}
        self.mutated_inputs = list(mutated_inputs)
        self.num_outputs = bundle.num_user_outputs - len(self.mutated_inputs)
        self.original = original
        #: Under a process group, each call first agrees with the other ranks how the step runs
        #: (:mod:`dcsched.train.agreement`): digests of this program's plan (0: none, it runs as captured) and of
        #: its step as captured; ``pending``: the decision its compile took for its first call.
        self.plan_digest = 0
        self.captured_digest = 0
        self.pending: str | None = None
        self._as_captured: ScheduledProgram | None = None
        #: The calls that ran the step as captured rather than planned.
        self.captured_steps = 0
        #: Whether the plan came from a stored plan file (``--plan FILE``) rather than this compile's own planning.
        self.reused_plan = False
        #: Set True to time every graph run and track its peak memory (for --report); stats go to ``stats``.
        self.measure = False
        #: With ``measure``: track memory too (the tracker slows the run; False: time alone, ``peak_bytes`` None).
        #: Inductor's kernels allocate their buffers without a dispatched op, where the tracker cannot see them.
        self.track_memory = compute == "eager"
        #: With ``measure``: tensors the step holds beside the graphs (the training loop's optimizer states,
        #: parameters, batch), given by this function and counted in the measured peaks too (whole-step peaks).
        self.also_tracked: Callable[[], Any] | None = None
        self.stats: list[StepStats] = []

    def __call__(self, *args):
        self.sharding.check_intact()
        program = self._agreed(args)
        forward_args = [program.param_at[pos].param if pos in program.param_at else value
                        for pos, value in enumerate(args)]
        outputs = _ScheduledStep.apply(program, *forward_args)
        with torch.no_grad():
            for k, pos in enumerate(program.mutated_inputs):
                args[pos].copy_(outputs[program.num_outputs + k])
        return list(outputs[:program.num_outputs])

    def _agreed(self, args) -> "ScheduledProgram":
        """This program, or its step as captured where the ranks agreed on that (:mod:`dcsched.train.agreement`)."""
        if self.sharding.world_size < 2:
            return self
        decision, self.pending = self.pending, None
        if decision is None:  # a cached program: the others may be compiling, or hold other shapes
            from dcsched.train.agreement import announce
            decision = announce(self.sharding, args, compiling=False, plan=self.plan_digest,
                                captured=self.captured_digest, what=type(self.sharding.module).__name__)
        if decision == "planned":
            return self
        self.captured_steps += 1
        if self.plan_digest == 0:  # compiled while the ranks' shapes differed: it has no plan
            return self
        if self._as_captured is None:  # the captured order, one collective per parameter: what every rank runs
            self._as_captured = ScheduledProgram(self.sharding, self.original, self.original, self.mutated_inputs,
                                                 "none", compute=self.compute)
        return self._as_captured

    # -- the two graphs ----------------------------------------------------
    def _timed(self, run, tracked: list):
        if not self.measure:
            return run(), None
        _sync(self.device)
        tracker = LiveBytes() if self.track_memory else None
        with tracker if tracker is not None else contextlib.nullcontext():
            if tracker is not None:
                tracker.track(tracked)
                if self.also_tracked is not None:
                    tracker.track(self.also_tracked())
                tracker.reset_peak()
            start = time.perf_counter_ns()
            result = run()
            _sync(self.device)
            ms = (time.perf_counter_ns() - start) / 1e6
        return result, GraphStats(ms, tracker.peak if tracker is not None else None)

    def run_forward(self, args: list) -> list:
        with installed(self.runtime):
            outputs, stats = self._timed(lambda: run_forward(self.step, args), [args, self.step.constants])
        if stats is not None:
            self.stats.append(StepStats(stats))
        return outputs

    def _backward(self, saved: list, tangents: list) -> list:
        return run_backward(self.step, saved, tangents)  # waits on the asynchronous reduce-scatters

    def run_backward(self, saved: list, tangents: list) -> list:
        with installed(self.runtime):
            # kept parameters (held by the runtime since the forward) are the backward's too
            held = list(getattr(self.runtime, "held", {}).values())
            grads, stats = self._timed(lambda: self._backward(saved, tangents),
                                       [saved, tangents, self.step.constants, held])
        if stats is not None and self.stats:
            self.stats[-1].backward = stats
        return grads


def _differentiable(value) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


class _ScheduledStep(torch.autograd.Function):
    """Forward graph forward, backward graph backward; the program rides along as the first argument."""

    @staticmethod
    def forward(ctx, program: ScheduledProgram, *args):
        outputs = program.run_forward(list(args))
        n_user = program.bundle.num_user_outputs
        user = outputs[:n_user]
        # The saved tensors alone (the user outputs are returned, not kept here: that would make a cycle);
        # the backward empties the list as it goes, freeing each after its last use.
        ctx.saved = [None] * n_user + outputs[n_user:]
        ctx.program = program
        ctx.specs = [(tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else None for v in user]
        outputs.clear()
        frozen = [v for k, v in enumerate(user) if isinstance(v, torch.Tensor)
                  and (k >= program.num_outputs or not _differentiable(v))]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(user)

    @staticmethod
    def backward(ctx, *grad_outputs):
        program: ScheduledProgram = ctx.program
        tangents = []
        for grad, spec in zip(grad_outputs, ctx.specs):
            if grad is None and spec is not None:
                grad = torch.zeros(spec[0], dtype=spec[1], device=spec[2])
            tangents.append(grad)
        saved, ctx.saved = ctx.saved, None
        grads = program.run_backward(saved, tangents)
        # reduced in the reduce dtype (mp_policy), each lands in its shard's dtype (the waits are done)
        for pos, spec in program.param_at.items():
            if pos < len(grads) and isinstance(grads[pos], torch.Tensor) and grads[pos].dtype != spec.dtype:
                grads[pos] = grads[pos].to(spec.dtype)
        return (None, *grads)
