"""The whole training step's memory per rank: the graphs' simulated peaks with what the step holds beside them.

:func:`step_memory` takes a bundle (its plans, the optimizer its script built
or one named) and gives a :class:`StepMemory`: the step's peak and its parts by
kind (:data:`KINDS`), which add up to it exactly. The step has three phases,
each simulated and the largest taken:

- **forward**: the forward graph at its simulated peak (its plan: buckets, kept
  parameters), with the optimizer's states resident beside it;
- **backward**: the backward graph at its peak, with what the step holds across
  it (the forward's inputs and user outputs the backward does not take, as
  :func:`dcsched.sim.bundle_figures.simulated_figures` counts them) and the
  optimizer's states;
- **optimizer**: the optimizer's update: parameter shards, their gradients (in
  the shard's dtype, where the reduced gradients land), the states and the
  update's temporaries (:mod:`dcsched.bundle.optimizer`).

At a graph's peak the live bytes are split by what holds them: parameter
shards (the inputs all-gathers read), gathered parameters, reduced gradient
shards, the mixed-precision casts of gradients before their reduces (graph
nodes a policy adds, :func:`dcsched.train.mixed_precision.carry_dtypes`),
collective buffers (buckets' flat tensors, gloo's staging copies) and
activations (everything else the graph holds: saved tensors, temporaries).
Where the target is a GPU the step's live tensors are also costed under the
CUDA caching allocator (:mod:`dcsched.sim.allocator`).

>>> from dcsched import replay
>>> memory = step_memory(replay.example_bundle(), "adamw")
>>> sum(memory.parts.values()) == memory.peak_bytes
True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dcsched.collective_issue import SIMULATOR, CollectiveIssue
from dcsched.graph.form import COMPUTE, PLACEHOLDER, REDUCE, WAIT
from dcsched.sim.allocator import CudaFootprint, cuda_footprint
from dcsched.sim.fused import HELD, Fused
from dcsched.bundle.optimizer import OptimizerModel, from_provenance, named, of_torch

#: The kinds the step's peak is split into, in the report's order.
KINDS = ("parameter_shards", "gradient_shards", "optimizer_states", "optimizer_temporaries",
         "mixed_precision_copies", "gathered_parameters", "activations", "collective_buffers")
#: Bytes of the 0-d fp32 ``step`` tensor torch.optim keeps per parameter (Adam's, AdamW's, ...).
STEP_SCALAR_BYTES = 4


@dataclasses.dataclass(frozen=True)
class GraphPeak:
    """One graph at its simulated peak: where (``position`` in its order, ``node``), the peak, its parts by
    kind (adding up to it) and the sizes of the tensors live there (for the allocator model)."""

    graph: str
    position: int
    node: str | None
    peak_bytes: int
    parts: dict[str, int]
    sizes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """The whole step's peak memory per rank and its parts by kind (:data:`KINDS`; they add up to
    ``peak_bytes``). ``phase``: where the peak is (``forward``, ``backward``, ``optimizer``), ``node`` the
    graph node there; ``phases``: each phase's peak; ``optimizer``: the optimizer's name (None: none known, its
    states not counted); ``cuda``: the caching allocator's figures where the target is a GPU, else None."""

    peak_bytes: int
    parts: dict[str, int]
    phase: str
    node: str | None
    phases: dict[str, int]
    optimizer: str | None
    world_size: int | None
    cuda: CudaFootprint | None = None

    def to_json(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "parts": dict(self.parts), "phase": self.phase, "node": self.node,
                "phases": dict(self.phases), "optimizer": self.optimizer, "world_size": self.world_size,
                "cuda_allocator": self.cuda.to_json() if self.cuda is not None else None}


def graph_peak(compiled, plan, graph: str, *, issue: CollectiveIssue = SIMULATOR,
               casts: frozenset = frozenset()) -> GraphPeak:
    """Graph ``graph`` (compiled) run as ``plan`` says, at its simulated peak, split by kind.

    ``casts``: names of the nodes that cast a gradient to the reduce dtype (mixed-precision copies). The
    peak is :func:`dcsched.sim.plans.simulate_plan`'s; activations are what the other kinds leave of it.
    """
    from dcsched.sim.plans import plan_fused
    from dcsched.sim.staging import staging_series

    idx, fused = plan_fused(compiled, plan, graph, issue=issue, check=False)
    memory, gathered, free = compiled.memory_with_frees(idx, fused=fused)
    if not memory:
        return GraphPeak(graph, -1, None, 0, dict.fromkeys(KINDS, 0), ())
    peak = max(memory)
    p = memory.index(peak)
    kind, owned, size = compiled.kind, compiled.owned, compiled.size
    pos_of = {i: pos for pos, i in enumerate(idx)}
    lead = fused.lead if fused is not None else None

    def allocated_at(i: int) -> int:
        if compiled.is_input[i] or (lead is not None and lead[i] == HELD):
            return -1
        if compiled.part_of[i] >= 0:
            return pos_of[compiled.part_of[i]]
        return pos_of[lead[i]] if lead is not None and lead[i] >= 0 else pos_of[i]

    live = [r for r in compiled.owners if allocated_at(r) <= p and (free[r] < 0 or free[r] >= p)]
    shards = [size[i] for i in range(len(kind)) if compiled.pinned[i] and kind[i] == PLACEHOLDER]
    grads = [owned[r] for r in live if kind[r] == REDUCE]
    cast_bytes = [owned[r] for r in live if kind[r] == COMPUTE and compiled.names[r] in casts]
    gather_flats, other_flats = _bucket_buffers_at(compiled, idx, p, fused)
    staged = staging_series(idx, kind, owned, size, compiled.preds, compiled.succs, fused)[p] \
        if fused is not None and fused.issue.staging else 0
    # a replicated parameter's shard placeholder is its whole copy's (the gathered series counts the whole less
    # the placeholder): gathered, not a shard
    whole = _replicated_shard_bytes(compiled, plan)
    parts = dict.fromkeys(KINDS, 0)
    parts.update(parameter_shards=int(sum(shards)) - whole, gradient_shards=int(sum(grads)),
                 mixed_precision_copies=int(sum(cast_bytes)),
                 gathered_parameters=int(gathered[p] - gather_flats) + whole,
                 collective_buffers=int(gather_flats + other_flats + staged))
    parts["activations"] = int(peak) - sum(parts.values())
    sizes = tuple(int(owned[r]) for r in live) + tuple(int(s) for s in shards) + \
        tuple(int(b) for b in (gather_flats, other_flats, staged) if b)
    return GraphPeak(graph, p, compiled.names[idx[p]], int(peak), parts, sizes)


def _replicated_shard_bytes(compiled, plan) -> int:
    """The bytes of the shard placeholders of ``plan``'s replicated parameters (what their gathers read)."""
    from dcsched.graph.form import ALLGATHER
    from dcsched.sim.plans import replicated_ids
    replicated = replicated_ids(plan)
    if not replicated:
        return 0
    kind, ds_id = compiled.kind, compiled.ds_id
    shards = {q for i in range(len(kind)) if kind[i] == ALLGATHER and ds_id[i] in replicated
              for q in compiled.preds[i] if kind[q] == PLACEHOLDER}
    return int(sum(compiled.size[q] for q in shards))


def _bucket_buffers_at(compiled, idx: list[int], p: int, fused: Fused | None) -> tuple[int, int]:
    """The flat buffers the memory series counts at position ``p`` beside the nodes' own
    (:meth:`~dcsched.sim.memory.MemoryModel._with_bucket_buffers`): (all-gather buckets', reduce buckets')."""
    if fused is None or not fused.time:
        return 0, 0
    kind, lead, preds, succs, size, owned = compiled.kind, fused.lead, compiled.preds, compiled.succs, \
        compiled.size, compiled.owned
    position = {i: q for q, i in enumerate(idx)}
    groups: dict[int, list[int]] = {}
    for i in idx:
        if lead[i] >= 0:
            groups.setdefault(lead[i], []).append(i)
    gather = reduce = 0
    for first, members in groups.items():
        if len(members) < 2:
            continue
        if kind[first] == REDUCE:
            if position[first] == p:
                reduce += sum(size[preds[m][0]] for m in members)
            continue
        waits = [position[w] for m in members for w in succs[m] if kind[w] == WAIT and w in position]
        if min(waits, default=position[first]) == p:
            gather += sum(owned[m] for m in members)
    return gather, reduce


def _gradient_casts(graph) -> frozenset:
    """Names of the nodes casting a gradient to another dtype right before its reduce (a policy's)."""
    from dcsched.graph.roles import Role, role_of
    return frozenset(node.name for node in graph.nodes
                     if "convert_element_type" in str(node.target)
                     and any(role_of(user) is Role.REDUCE for user in node.users))


def resolve_optimizer(bundle, optimizer: Any = None) -> OptimizerModel | None:
    """The optimizer to count: ``optimizer`` (a name, an :class:`OptimizerModel` or a ``torch.optim``
    instance), else the one the bundle's provenance records, else None.

    Raises
    ------
    OptimizerError
        An unknown name, an optimizer class dcsched does not model, or a record out of bounds.
    """
    from dcsched.bundle.optimizer import OptimizerError
    if optimizer is None:
        return from_provenance(bundle.provenance)
    if isinstance(optimizer, OptimizerModel):
        return optimizer
    if isinstance(optimizer, str):
        return named(optimizer)
    model = of_torch(optimizer)
    if model is None:
        raise OptimizerError(f"dcsched does not model the optimizer {type(optimizer).__name__}: name one of its "
                             "known ones instead (dcsched.bundle.optimizer.KNOWN)")
    return model


def on_gpu(provenance: dict) -> bool:
    """Whether the bundle's figures are for a GPU (profiled on CUDA, or an analytic model of a named GPU).

    >>> on_gpu({"device": "cpu (x86_64)"}), on_gpu({"device": "h100 (analytic, not run)", "gpu": "H100"})
    (False, True)
    """
    device = str(provenance.get("device", ""))
    return device.startswith("cuda") or (not device.startswith("cpu") and bool(provenance.get("gpu")))


def step_memory(bundle, optimizer: Any = None, *, world_size: int | None = None,
                issue: CollectiveIssue = SIMULATOR, gpu: bool | None = None, plans: Mapping | None = None
                ) -> StepMemory:
    """The whole step's peak memory per rank for ``bundle`` run as its plans say, split by kind.

    Parameters
    ----------
    bundle : Bundle
        A profiled bundle (its graphs' ``tensor_size`` figures); its plans, where it has them, are run.
    optimizer : str, OptimizerModel or torch.optim.Optimizer, optional
        The optimizer whose states to count (:data:`dcsched.bundle.optimizer.KNOWN` names); by default the one the
        bundle's provenance records (a script's), else none (its states are not counted).
    world_size : int, optional
        Re-shard the bundle to this many ranks first (as :func:`~dcsched.sim.bundle_figures.simulated_figures`).
    issue : CollectiveIssue
        How the collectives are issued (:class:`~dcsched.collective_issue.CollectiveIssue`).
    gpu : bool, optional
        Whether the target is a GPU (the allocator model and ``foreach`` updates); by default
        :func:`on_gpu` of the provenance.
    plans : Mapping of str to Plan, optional
        The plans to run instead of the bundle's own (by graph name; a graph without one runs its own order).

    Returns
    -------
    StepMemory

    Raises
    ------
    OptimizerError
        As :func:`resolve_optimizer`.
    GraphError
        A graph the simulator refuses (missing figures, a plan that cannot run).
    """
    from dcsched.bundle.resharding import resharded
    from dcsched.plan import Plan
    from dcsched.sim.collectives import latency_from_provenance
    from dcsched.sim.reuse import compiled

    model = resolve_optimizer(bundle, optimizer)
    profiled_for = bundle.provenance.get("world_size")
    if world_size is not None and isinstance(profiled_for, int) and profiled_for != world_size:
        bundle = resharded(bundle, world_size)
    gpu = on_gpu(bundle.provenance) if gpu is None else gpu
    latency = latency_from_provenance(bundle.provenance)
    plans = bundle.plans if plans is None else plans
    peaks = {}
    for name in ("forward", "backward"):
        graph = bundle.graphs.get(name)
        if graph is not None:
            view = _storage_view(bundle, graph) if name == "backward" else graph
            peaks[name] = graph_peak(compiled(view, comm_latency_ms=latency), plans.get(name) or Plan(()),
                                     name, issue=issue, casts=_gradient_casts(graph))
    shards = _param_shard_bytes(bundle)
    states = _optimizer_states(model, shards, gpu)
    phases: dict[str, tuple[dict[str, int], tuple[int, ...], str | None]] = {}
    for name, at in peaks.items():
        parts = dict(at.parts)
        parts["optimizer_states"] += sum(states)
        sizes = at.sizes + tuple(states)
        if name == "backward":
            held_params, held_other = _held_across(bundle)
            parts["parameter_shards"] += held_params
            parts["activations"] += held_other
            sizes += (held_params, held_other)
        phases[name] = (parts, sizes, at.node)
    temporaries = _temporaries(model, shards, gpu)
    update = dict.fromkeys(KINDS, 0)
    update.update(parameter_shards=sum(shards), gradient_shards=sum(shards), optimizer_states=sum(states),
                  optimizer_temporaries=sum(temporaries))
    phases["optimizer"] = (update, tuple(shards) * 2 + tuple(states) + tuple(temporaries), None)
    totals = {name: sum(parts.values()) for name, (parts, _, _) in phases.items()}
    phase = max(totals, key=lambda name: totals[name])  # the first of equals: forward, backward, optimizer
    parts, sizes, node = phases[phase]
    cuda = None
    if gpu:
        cuda = _cuda(bundle, sizes, totals[phase], (shards, states, temporaries), plans, issue)
    return StepMemory(totals[phase], parts, phase, node, totals, model.name if model else None,
                      bundle.provenance.get("world_size") if world_size is None else world_size, cuda)


def _cuda(bundle, sizes: tuple[int, ...], peak: int, step: tuple[list[int], list[int], list[int]], plans: Mapping,
          issue: CollectiveIssue) -> CudaFootprint:
    """The caching allocator's figures: the blocks of the tensors live at the peak (``allocated``), and the
    segments the allocator simulated over two steps' allocations and frees reserves
    (:mod:`dcsched.sim.caching_allocator`, :mod:`dcsched.sim.step_events`), never less than the peak's tensors
    packed perfectly (which holds the collective buffers the events leave out)."""
    from dcsched.sim.caching_allocator import replay
    from dcsched.sim.step_events import step_events
    footprint = cuda_footprint(sizes)
    unsized = max(0, peak - sum(sizes))  # what the split leaves unattributed to one tensor
    packed = footprint.reserved_bytes + unsized
    simulated = replay(step_events(bundle, *step, plans=plans, issue=issue))
    return CudaFootprint(footprint.allocated_bytes + unsized, max(simulated.reserved_bytes, packed),
                         packed_reserved_bytes=packed)


def _storage_view(bundle, graph):
    """The backward graph's form with each saved tensor counted at its storage's bytes, a storage shared by
    saved tensors once (:func:`dcsched.sim.saved_storage.saved_storage_bytes`); the graph itself where none
    differs. One view per bundle and graph within :func:`dcsched.sim.reuse.reusing`."""
    from dcsched.sim.reuse import once
    return once("storage view", bundle, lambda: _new_storage_view(bundle, graph), id(graph))


def _new_storage_view(bundle, graph):
    from dcsched.graph.form import GraphForm
    from dcsched.sim.saved_storage import saved_storage_bytes
    counted = saved_storage_bytes(bundle)
    if not counted:
        return graph
    form = GraphForm(graph)
    sizes = list(form.tensor_size)
    for name, nbytes in counted.items():
        sizes[form.index[name]] = nbytes
    form.tensor_size = sizes
    form.size = [0 if s is None else s for s in sizes]
    return form


def _param_shard_bytes(bundle) -> list[int]:
    """Each parameter shard's bytes on one rank, as the forward's parameter placeholders record them."""
    from dcsched.graph.specs import recorded_bytes
    placeholders = [node for node in bundle.forward.nodes if node.op == "placeholder"]
    return [recorded_bytes(node) for node, entry in zip(placeholders, bundle.forward_placeholders)
            if entry.get("kind") == "param"]


def _optimizer_states(model: OptimizerModel | None, shards: list[int], gpu: bool) -> list[int]:
    """The optimizer's state tensors' bytes: ``state_tensors`` per shard in its dtype, the ``step`` scalars (on
    the CPU: not a GPU's memory)."""
    if model is None:
        return []
    states = [s for s in shards for _ in range(model.state_tensors)]
    if model.step_scalar and not gpu:
        states += [STEP_SCALAR_BYTES] * len(shards)
    return states


def _temporaries(model: OptimizerModel | None, shards: list[int], gpu: bool) -> list[int]:
    """What the update allocates at once: on a GPU torch's multi-tensor update (lists the size of all shards),
    on the CPU its single-tensor one, which loops over the parameters (in their order): ``single_temporaries``
    of one parameter's size, while the previous parameter's last one is still bound to the loop's variable
    (AdamW's ``denom``), at the pair of neighbours where that is largest."""
    if model is None or not shards:
        return []
    if gpu:
        return list(shards) * model.foreach_temporaries
    if not model.single_temporaries:
        return []
    previous = [0, *shards[:-1]]
    at = max(range(len(shards)), key=lambda i: previous[i] + model.single_temporaries * shards[i])
    return [s for s in [previous[at]] + [shards[at]] * model.single_temporaries if s]


def _held_across(bundle) -> tuple[int, int]:
    """What the step holds across the backward beside its graph (the forward's inputs and user outputs the
    backward does not take, as :func:`~dcsched.sim.bundle_figures.simulated_figures` counts them): (parameter
    shards, the rest)."""
    from dcsched.graph.specs import flat_nodes, recorded_bytes
    from dcsched.sim.reuse import compiled
    from dcsched.sim.saved_storage import saved_forward_roots
    if bundle.backward is None:
        return 0, 0
    output = next(node for node in bundle.forward.nodes if node.op == "output")
    outputs = flat_nodes(output.args)
    saved = {outputs[int(e["index"])] for e in bundle.backward_placeholders
             if e.get("kind") == "saved" and 0 <= int(e["index"]) < len(outputs)}
    placeholders = [node for node in bundle.forward.nodes if node.op == "placeholder"]
    params = {node for node, entry in zip(placeholders, bundle.forward_placeholders) if entry.get("kind") == "param"}
    inputs = [node for node in bundle.forward.nodes if node.op in ("placeholder", "get_attr")]
    forward = compiled(bundle.forward, assume_zero=True)
    shared = saved_forward_roots(bundle)  # a user output viewing a saved tensor's storage is counted with it
    held = [n for n in dict.fromkeys(inputs + outputs[:bundle.num_user_outputs])
            if n not in saved and forward.root[forward.index[n.name]] not in shared]
    return (sum(recorded_bytes(n) for n in held if n in params),
            sum(recorded_bytes(n) for n in held if n not in params))



def compared_step_memory(bundle, comparison, optimizer: Any = None) -> dict[str, StepMemory]:
    """The whole step's memory of ``bundle`` as it stands (``'before'``, its own plans) and under each algorithm of
    a :class:`dcsched.report.compare.Comparison` (its plans for every graph): what ``dcsched schedule`` reports.

    Raises
    ------
    OptimizerError
        As :func:`resolve_optimizer`.
    """
    from dcsched.graph.form import paused_gc
    from dcsched.sim.reuse import reusing
    # the graphs compiled, their saved storages found, once for all the plans; 10^5 small containers made beside
    # the FX graphs and no cycles: no full collections
    with reusing(), paused_gc():
        out = {"before": step_memory(bundle, optimizer)}
        for algo in comparison.algorithms:
            plans = {name: cmp.plans[algo] for name, cmp in comparison.graphs.items() if algo in cmp.plans}
            out[algo] = step_memory(bundle, optimizer, plans=plans)
    return out


def bundle_step_memory(bundle, optimizer: Any = None) -> StepMemory | None:
    """:func:`step_memory` of ``bundle`` as it stands, or None where its graphs do not simulate (figures
    missing: an unprofiled bundle): what ``dcsched show`` reports.

    Raises
    ------
    OptimizerError
        As :func:`resolve_optimizer` (checked first, whether or not the bundle simulates).
    """
    from dcsched.errors import GraphError
    model = resolve_optimizer(bundle, optimizer)
    try:
        return step_memory(bundle, model)
    except GraphError:
        return None
