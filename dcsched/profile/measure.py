"""Profile a bundle: ``device_time`` (ms) and ``tensor_size`` (bytes) for every node, with provenance.

Compute times come from a cost model (:mod:`dcsched.costmodels`, one module
each, chosen by name):

* ``measured``: the graphs run for real through :mod:`dcsched.runtime.step` (forward,
  then backward on the forward's saved tensors with the step runner's tangents:
  ones for the loss, zeros for other outputs); each compute node is run
  ``warmup`` times, then timed ``iters`` times, and the median is kept. On a
  GPU with CUDA events, on the CPU with ``time.perf_counter_ns``.
* ``analytic``: nothing runs; a roofline estimate for a named GPU from each
  node's FLOPs and the bytes of its inputs and outputs, so a laptop can plan
  for a cluster.
* ``calibrated``: the analytic estimate times per-op-kind factors measured on a
  GPU (:class:`~dcsched.costmodels.options.ProfileOptions` ``(calibration="factors.json")``; with the analytic model a
  calibration file selects this one).

Communication nodes: the run's :class:`~dcsched.costmodels.topology.Topology`
(:func:`profile_topology`, resolved once where the run starts) gives the world
size W: a process group's size where one of more than one rank runs here (an
options' ``world_size`` that differs is refused), else the options'
``world_size`` (default 8). The measured model under such a group measures the
all-gather and the gradient reduce-scatter with real collectives of the same
size; otherwise (one process, or a model that runs nothing) they are modelled
from their bytes with ``bytes*(W-1)/W / bandwidth + latency``, the latency and
bandwidth given in the options or else the interconnect table's for the target
GPU kind, W and the ranks per node (:mod:`dcsched.costmodels.interconnects`).
Wait and release cost 0. The provenance says which (``comm_time``) and records
the latency the figures include (``comm_latency_ms``).

Under a process group every rank profiles, and the figures are then made the
same on every rank (:mod:`dcsched.runtime.consensus`): each node's ``device_time`` is
the maximum over the ranks, the target memory the smallest, after a check that
every rank holds the same step. A scheduler run on each rank then makes one
plan.

``tensor_size`` is the bytes of a node's outputs, from the recorded shapes,
with ZeRO-3 sharding over W ranks applied: a parameter placeholder holds its
shard (``ceil(numel/W) * itemsize``), an all-gather the gathered parameter
(full size), a reduce-grad this rank's gradient shard.

Every node also gets ``time_source`` (``measured``, ``modelled``, ``analytic``,
``calibrated`` or ``none`` for placeholders and outputs); ``bundle.provenance``
records how the figures were obtained.

>>> from dcsched import replay
>>> profiled = profile_bundle(replay.example_bundle(), ProfileOptions(cost_model="analytic", gpu="h100",
...                                                                  progress=False))
>>> profiled.provenance["device"], profiled.provenance["target_memory_bytes"] == 81559 * 2**20
('h100 (analytic, not run)', True)
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import torch

from dcsched.costmodels.base import CostModel, ProfileRun
from dcsched.costmodels.registry import build as build_cost_model
from dcsched.costmodels.topology import Topology, resolve_topology

from dcsched.runtime import consensus
from dcsched.bundle.core import Bundle
from dcsched.costmodels.options import ProfileOptions
from dcsched.graph.nxview import copy_graph
from dcsched.bundle.resharding import tensor_sizes


#: ``provenance['data']`` of a bundle captured with ``meta=True``; ``provenance['planned']`` is True there.
PLANNED = "none: planned from shapes on the meta device, not measured (no weights, no input values)"


# ---------------------------------------------------------------------------
# The profiler
# ---------------------------------------------------------------------------

def with_sizes(bundle: Bundle, world_size: int) -> Bundle:
    """A copy of ``bundle`` (graphs copied) whose nodes carry ``tensor_size`` for ``world_size`` ranks."""
    bundle = bundle.with_graphs(**{name: copy_graph(g) for name, g in bundle.graphs.items()})
    sizes = tensor_sizes(bundle, world_size)
    for name, graph in bundle.graphs.items():
        for node in graph.nodes:
            node.meta["tensor_size"] = sizes[name][node.name]
    return bundle


def profile_topology(options: ProfileOptions, *, group_size: int | None = None) -> Topology:
    """The topology a profile with ``options`` has here: resolved once where a run starts, then passed down.

    ``group_size``: the ranks of the process group the run's collectives go over (training passes its
    sharding's); by default the default process group's size (1 where there is none). Ranks per node come from
    torchrun's ``LOCAL_WORLD_SIZE``. See :func:`~dcsched.costmodels.topology.resolve_topology`.

    Raises
    ------
    OptionError
        Options no profile can use, or a ``world_size`` other than a process group's size.

    Examples
    --------
    >>> profile_topology(ProfileOptions(cost_model="analytic", gpu="a100", world_size=16)).describe()
    'world size 16, a100, 2 nodes: InfiniBand HDR, 8x200 Gb/s per node'
    """
    options.check()
    size = consensus.group_size() if group_size is None else group_size
    return resolve_topology(options, build_cost_model(options), group_size=size, local_size=_local_size())


def _local_size() -> int | None:
    """Ranks on this node, as torchrun sets ``LOCAL_WORLD_SIZE``; None where unset or not a count."""
    text = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(text) if text.isascii() and text.isdigit() and 0 < int(text) < 2**20 else None


def comm_description(model: CostModel, topology: Topology) -> str:
    """``provenance['comm_time']``: whether the collectives were measured or modelled, for what and how.

    >>> options = ProfileOptions(cost_model="analytic", gpu="h100", world_size=2)
    >>> comm_description(build_cost_model(options), profile_topology(options))
    'modelled (analytic cost model, one process): h100, world size 2, 1 node: latency 15 us + bytes*(W-1)/W at 360 GB/s (h100, 1 node: NVLink 4 / NVSwitch)'
    """  # noqa: E501
    if model.measures_collectives(topology):
        return (f"measured ({model.name} cost model): real all-gathers and reduce-scatters of each node's size "
                f"over the process group's {topology.world_size} ranks (median per rank, the slowest rank's); "
                f"latency measured as an all-gather of one float a rank")
    link = topology.link
    how = f"{model.name} cost model, " + ("the process group's collectives not run" if topology.process_group
                                          else "one process")
    where = f"{topology.nodes} node{'s' if topology.nodes > 1 else ''}"
    return (f"modelled ({how}): {topology.device_kind}, world size {topology.world_size}, {where}: latency "
            f"{link.latency_us:g} us + bytes*(W-1)/W at {link.bandwidth_gbps:g} GB/s ({link.name})")


def _provenance(model: CostModel, options: ProfileOptions, run: ProfileRun, device: str) -> dict:
    target_gpu = model.target_gpu(options)
    how = model.provenance(options)
    topology = run.topology
    # Measured collectives include no figure of the link: None; their latency is measured (the measured model's).
    link = None if model.measures_collectives(topology) else topology.link
    return {
        "cost_model": model.name,
        "device_time": how["device_time"],
        "comm_time": comm_description(model, topology),
        "tensor_size": "bytes of node outputs from recorded shapes; parameters and gradients as 1/W shards",
        "device": device,
        "gpu": target_gpu.name if target_gpu else None,
        "target_memory_bytes": model.target_memory(options),
        "torch": str(torch.__version__),
        "world_size": topology.world_size,
        "ranks_per_node": topology.ranks_per_node,
        # The latency every collective's figure includes, what a bucket of them saves per extra member
        # (dcsched.sim.collectives): the modelled link's, or where the collectives were measured the measured
        # model's own measurement (an all-gather of one float a rank). In ms like every time of the bundle.
        "comm_latency_ms": model.comm_latency_ms(run),
        "comm_bandwidth_GBps": None if link is None else link.bandwidth_gbps,
        "comm_link": None if link is None else link.name,
        "iters": how["iters"],
        "warmup": how["warmup"],
    }


def profile_bundle(bundle: Bundle, options: ProfileOptions = ProfileOptions(), *,
                   params: Mapping[int, torch.Tensor] | None = None,
                   inputs: Sequence[torch.Tensor] | None = None, topology: Topology | None = None) -> Bundle:
    """A copy of ``bundle`` whose nodes carry ``device_time``, ``tensor_size`` and ``time_source``.

    Parameters
    ----------
    bundle : Bundle
        The captured graphs (:func:`dcsched.capture`, :func:`dcsched.capture_script`); left unchanged.
    options : ProfileOptions
        The cost model and its settings (:class:`~dcsched.costmodels.options.ProfileOptions`).
    params : Mapping[int, torch.Tensor], optional
        ds_id -> full parameter, the real tensors to run a measured profile with; by default the step
        runner's seeded ones (:func:`dcsched.runtime.step.make_state`).
    inputs : Sequence[torch.Tensor], optional
        The step inputs in ``bundle.inputs`` order; by default seeded ones made from the bundle.
    topology : Topology, optional
        The ranks the figures are for and the link of modelled collectives, as the caller that started the
        run resolved it (:func:`profile_topology`); by default resolved here from ``options`` and the process
        group.

    Returns
    -------
    Bundle
        A copy with ``device_time`` (ms), ``tensor_size`` (bytes) and ``time_source`` on every node and
        ``provenance`` saying how the figures were obtained.

    Raises
    ------
    OptionError
        ``options`` no profile can use (:meth:`ProfileOptions.check <dcsched.costmodels.options.ProfileOptions.check>`),
        or a ``world_size`` other than the size of the process group running here.
    DcschedError
        Under a process group, ranks that captured different steps.

    Examples
    --------
    >>> from dcsched import replay
    >>> options = ProfileOptions(cost_model="analytic", gpu="a100", world_size=4, progress=False)
    >>> profile_bundle(replay.example_bundle(), options).provenance["world_size"]
    4
    """
    topology = profile_topology(options) if topology is None else topology
    options.check()
    model = build_cost_model(options)
    run = ProfileRun(topology, params, inputs)
    bundle = with_sizes(bundle, topology.world_size)
    # Under a process group: the same step on every rank before the profile's collectives pair up, and the
    # same figures after (each rank timed its own nodes), so every rank's scheduler makes the same plan.
    consensus.check_same(consensus.step_fingerprints(bundle), "compiled")
    device = model.annotate(bundle, options, run)
    bundle.provenance = {**bundle.provenance, **_provenance(model, options, run, device)}
    consensus.agree_figures(bundle)
    return bundle
