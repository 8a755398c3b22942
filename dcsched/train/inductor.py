"""A scheduled graph compiled by inductor, every ZeRO-3 op left where the schedule put it.

``compute="eager"`` (the default) runs a scheduled graph's aten ops one by one,
node for node in the schedule's order: what the simulator models, so the
measured memory matches its figures. ``compute="inductor"`` hands the same
graph to inductor, as plain ``torch.compile`` would, so pointwise chains fuse
into one kernel each and the step runs at inductor's speed.

The ZeRO-3 ops survive compilation as they are. Inductor has no lowering for
them, so each becomes an opaque call in inductor's generated code, in the
graph's order; DeepCompile's graph shape chains them on data (a release takes
the activation computed from the gathered parameter and the next op reads the
release's output), so nothing that depends on a gather, a wait or a release
can move across it. Inductor's own reorderings (for peak memory, for locality)
are switched off so the compiled code keeps the schedule's order of the
computation between them too; fused kernels only merge neighbours.

How: the graph's constants become extra inputs, the graph is re-traced with
inductor's decompositions (``make_fx`` runs the nodes in order under fake
tensors, so the order is kept), then ``compile_fx_inner`` compiles it.
``fallback_random`` keeps aten's random number generators, so dropout draws
what the eager graph draws.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Mapping, Sequence

import torch
import torch.fx

from dcsched.errors import DcschedError, first_line
from dcsched.graph.roles import Role, role_of_target

#: inductor settings for a scheduled graph (see the module docstring).
INDUCTOR_CONFIG = {
    "reorder_for_peak_memory": False,
    "reorder_for_locality": False,
    "fallback_random": True,
}

COMPUTE_MODES = ("eager", "inductor")


def _lifted(module: torch.fx.GraphModule,
            order: Sequence[str] | None) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """A copy of ``module`` taking its inputs positionally in ``order`` (None: graph order), then its
    constants (get_attr) as extra trailing placeholders; and the constants."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = [node for node in module.graph.nodes if node.op == "placeholder"]
    if order is not None:
        by_name = {node.name: node for node in placeholders}
        placeholders = [by_name[name] for name in order]
    for node in placeholders:
        env[node] = graph.node_copy(node, lambda n: env[n])
    constants = [node for node in module.graph.nodes if node.op == "get_attr"]
    for node in constants:
        env[node] = graph.placeholder(f"dcsched_constant_{len(env)}")
    for node in module.graph.nodes:
        if node.op not in ("placeholder", "get_attr"):
            env[node] = graph.node_copy(node, lambda n: env[n])
    values = [getattr(module, node.target) for node in constants]
    return torch.fx.GraphModule(module, graph), values


class _Inlining(torch.fx.Interpreter):
    """Runs a graph under ``make_fx``, tracing the ZeRO-3 ops the runtime can express in aten ops into aten ops."""

    def __init__(self, module: torch.fx.GraphModule, inline: Mapping[Role, Callable]) -> None:
        super().__init__(module)
        self.inline = inline

    def call_function(self, target, args, kwargs):
        kernel = self.inline.get(role_of_target("call_function", target)) if self.inline else None
        if kernel is not None:
            return kernel(*args, **kwargs)
        return super().call_function(target, args, kwargs)


def compile_graph(module: torch.fx.GraphModule, inline: Mapping[Role, Callable] | None = None,
                  order: Sequence[str] | None = None,
                  compiling: Callable[[], ContextManager] | None = None) -> "InductorGraph":
    """``module`` (a scheduled graph taking one list of inputs, as :mod:`dcsched.runtime.step` builds) for inductor.

    The result takes the same list (and empties it) and returns the same
    outputs. It compiles on its first call, for the shapes, strides and
    devices of that call's inputs (a sharded parameter's placeholder holds
    the full-size shape, its input is this rank's 1-D shard). The ZeRO-3 ops'
    fake kernels read :data:`dcsched.runtime.ops.RUNTIME`, so the runtime the graph
    runs on must be installed then, as it is for every run.

    ``inline`` (role -> kernel): ZeRO-3 ops whose work the runtime can say in
    aten ops, traced in as those (world size 1: a gather is a view of the
    whole flat shard, a wait or a release nothing, a reduce a reshape), so
    inductor compiles them away; the other ops stay opaque calls. ``order``:
    the placeholder names in the order the list holds them, where the module
    takes them in another than the graph's (:attr:`dcsched.runtime.step.Step.orders`).
    ``compiling()``: a context manager the compile runs in (a progress display).
    """
    return InductorGraph(module, inline, order, compiling)


class InductorGraph:
    """A scheduled graph compiled by inductor on its first call; later calls run the compiled code.

    Inductor's kernels index their inputs with the strides they were compiled
    for and do not check them; an input laid out otherwise (a tangent autograd
    hands over non-contiguous) is copied into that layout first.
    """

    def __init__(self, module: torch.fx.GraphModule, inline: Mapping[Role, Callable] | None = None,
                 order: Sequence[str] | None = None, compiling: Callable[[], ContextManager] | None = None) -> None:
        self.inline, self.compiling = dict(inline or {}), compiling or contextlib.nullcontext
        self.compiled: Callable[[list], Sequence] | None = None
        self.strides: list[tuple | None] = []
        self.lifted, self.constants = _lifted(module, order)

    def _compile(self, args: Sequence) -> None:
        try:
            with self.compiling():
                self._compile_for(args)
        except DcschedError:
            raise
        except Exception as exc:  # say what to do instead of inductor's page of internals
            raise DcschedError(f"inductor could not compile a scheduled graph ({type(exc).__name__}: "
                               f"{first_line(exc, 200)}); "
                               "run it with `compute='eager'`") from exc

    def _compile_for(self, args: Sequence) -> None:
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor.decomposition import select_decomp_table
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx

        mode = FakeTensorMode()
        values = list(args) + self.constants
        examples = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in values]
        # A tracing context of our own: under TorchDynamo's, inductor would take its fake mode for ours.
        with torch._guards.tracing(torch._guards.TracingContext(mode)):
            with mode:
                interpreter = _Inlining(self.lifted, self.inline)
                traced = make_fx(interpreter.run, decomposition_table=select_decomp_table())(*examples)
            inputs = [node.meta["val"] for node in traced.graph.nodes if node.op == "placeholder"]
            with config.patch(INDUCTOR_CONFIG):
                self.compiled = compile_fx_inner(traced, inputs)
        self.strides = [tuple(v.stride()) if isinstance(v, torch.Tensor) else None for v in args]

    def __call__(self, args: list) -> list:
        if self.compiled is None:
            self._compile(args)
        inputs = [_laid_out(value, stride) for value, stride in zip(args, self.strides)]
        args.clear()  # as the eager module does: the caller's list no longer holds the inputs
        inputs.extend(self.constants)
        assert self.compiled is not None  # _compile set it
        return list(self.compiled(inputs))


def _laid_out(value, stride: tuple | None):
    if stride is None or not isinstance(value, torch.Tensor) or value.stride() == stride:
        return value
    return torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device).copy_(value)
