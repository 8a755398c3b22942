"""The cost-model interface, and what every model shares: communication figures and the static node loop.

A cost model fills ``device_time`` (ms) and ``time_source`` on every node of
a bundle whose ``tensor_size`` figures are already set, and says how it got
them. Communication nodes are the same for every model in one process: an
all-gather or a reduce-scatter is modelled from its bytes
(:func:`~dcsched.costmodels.formulas.comm_time_ms`) at the run's world size
with the latency and bandwidth of its link (both in the run's
:class:`~dcsched.costmodels.topology.Topology`: the options' figures, else the
interconnect table's for the target GPU kind and world size,
:mod:`~dcsched.costmodels.interconnects`), unless the model measures them
(:meth:`CostModel.measures_collectives`); waits and releases cost
0; placeholders, outputs and constants cost 0 with ``time_source`` ``none``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

import torch
import torch.fx

from dcsched.bundle.core import Bundle
from dcsched.graph.roles import COMM_ROLES, collective_of, role_of
from dcsched.graph.specs import node_bytes
from dcsched.costmodels.formulas import GPU, GPUS, comm_time_ms
from dcsched.costmodels.interconnects import GPUS_PER_NODE, Link, resolve
from dcsched.costmodels.topology import Topology

if TYPE_CHECKING:
    from dcsched.costmodels.options import ProfileOptions

#: Nodes that compute nothing and cost nothing.
FREE_OPS = ("placeholder", "output", "get_attr")


@dataclasses.dataclass
class ProfileRun:
    """What one profile works with besides the options: the topology, real tensors."""

    #: The ranks the figures are for and the link modelled collectives use, resolved where the run started.
    topology: Topology
    #: ds_id -> full parameter, or None for seeded random ones.
    params: Mapping[int, torch.Tensor] | None = None
    #: The step inputs in ``bundle.inputs`` order, or None for ones made from the bundle.
    inputs: Sequence[torch.Tensor] | None = None


def modelled_comm_time(node: torch.fx.Node, topology: Topology) -> float:
    """A collective's time (ms) from its bytes (the full parameter or gradient) over ``topology``'s ranks and
    link: its kind's cost (:attr:`dcsched.collectives.CollectiveKind.cost`), else an all-gather /
    reduce-scatter's for a collective on the communication stream; 0 otherwise."""
    kind = collective_of(node)
    link = topology.link
    if kind is not None and kind.cost is not None:
        return kind.cost(node_bytes(node), topology.world_size, link.bandwidth_gbps, link.latency_us)
    if kind is not None and kind.on_stream:
        return comm_time_ms(node_bytes(node), world_size=topology.world_size, bandwidth_gbps=link.bandwidth_gbps,
                            latency_us=link.latency_us)
    return 0.0


def progress_bar(enabled: bool):
    """A rich progress bar on stderr (drawn nothing when ``enabled`` is false)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), disable=not enabled, transient=True)


class CostModel(abc.ABC):
    """One way to obtain compute times. Subclasses set ``name`` and ``description`` and register."""

    name: ClassVar[str]
    description: ClassVar[str]
    #: Whether the model reads ``options.calibration`` (a factors file).
    takes_calibration: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def from_options(cls, options: ProfileOptions) -> CostModel:
        """The model for ``options``; raises :class:`~dcsched.errors.DcschedError` for options it cannot use."""

    @abc.abstractmethod
    def annotate(self, bundle: Bundle, options: ProfileOptions, run: ProfileRun) -> str:
        """Set ``device_time`` and ``time_source`` on every node; return the device the figures are for."""

    @abc.abstractmethod
    def provenance(self, options: ProfileOptions) -> dict[str, Any]:
        """``device_time`` (how compute times were obtained), ``iters`` and ``warmup`` (None unless run)."""

    def target_gpu(self, options: ProfileOptions) -> GPU | None:
        """The GPU the figures are for: the one ``options.gpu`` names, if any."""
        return GPUS[options.gpu.lower()] if options.gpu is not None else None

    def target_memory(self, options: ProfileOptions) -> int | None:
        """Bytes of the device the schedule is for: the target GPU's, else unknown."""
        gpu = self.target_gpu(options)
        return gpu.memory_bytes if gpu is not None else None

    def interconnect_kind(self, options: ProfileOptions) -> str:
        """The row of the interconnect table modelled collectives are costed with: the named GPU's, else ``cpu``."""
        return options.gpu.lower() if options.gpu is not None else "cpu"

    def link_note(self, options: ProfileOptions) -> str:
        """Why :meth:`interconnect_kind` took its row where that needs saying (added to the link's name)."""
        return ""

    def comm_link(self, options: ProfileOptions, world_size: int, ranks_per_node: int = GPUS_PER_NODE) -> Link:
        """The latency and bandwidth of modelled collectives over ``world_size`` ranks: the options' where
        given, else the table's row :meth:`interconnect_kind` names
        (:func:`~dcsched.costmodels.interconnects.interconnect`). A profile reads them from its topology
        (:func:`~dcsched.costmodels.topology.resolve_topology` calls this)."""
        link = resolve(self.interconnect_kind(options), world_size, latency_us=options.latency_us,
                       bandwidth_gbps=options.bandwidth_gbps, ranks_per_node=ranks_per_node)
        note = self.link_note(options)
        return dataclasses.replace(link, name=f"{link.name} {note}") if note else link

    def measures_collectives(self, topology: Topology) -> bool:
        """Whether this model runs the collectives (over ``topology``'s process group) rather than models them."""
        return False

    def comm_latency_ms(self, run: ProfileRun) -> float | None:
        """The per-collective latency (ms) the communication figures include, what a bucket saves per
        member after its first: the modelled link's, or None where collectives were measured and this
        model measured no latency (readers then take the default)."""
        return None if self.measures_collectives(run.topology) else run.topology.link.latency_us / 1e3


class StaticCostModel(CostModel):
    """A model that runs nothing: each compute node's time is a function of its recorded shapes."""

    @abc.abstractmethod
    def compute_time(self, node: torch.fx.Node) -> tuple[float, str]:
        """(ms, time_source) of one compute node."""

    def annotate(self, bundle: Bundle, options: ProfileOptions, run: ProfileRun) -> str:
        total = sum(len(graph.nodes) for graph in bundle.graphs.values())
        with progress_bar(options.progress) as progress:
            task = progress.add_task("estimating", total=total)
            for graph in bundle.graphs.values():
                for node in graph.nodes:
                    if node.op in FREE_OPS:
                        node.meta.update(device_time=0.0, time_source="none")
                    elif role_of(node) in COMM_ROLES:
                        node.meta.update(device_time=modelled_comm_time(node, run.topology),
                                         time_source="modelled")
                    else:
                        ms, source = self.compute_time(node)
                        node.meta.update(device_time=ms, time_source=source)
                    progress.advance(task)
        return self.device_description()

    @abc.abstractmethod
    def device_description(self) -> str:
        """What ``provenance['device']`` says, e.g. ``h100 (analytic, not run)``."""
