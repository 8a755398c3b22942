"""The ranks a profile's figures are for and what carries their collectives: one value, resolved where a run starts.

A :class:`Topology` holds the world size, the ranks on each node, the
interconnect table's row (the device kind) and the link modelled collectives
are costed on, and whether a process group of that many ranks runs here. It is
resolved once (:func:`resolve_topology`), from the options and the process
group, by whatever starts a run (``dcsched profile``,
:func:`dcsched.profile_bundle`, training's compile), and every cost model
reads it: none derives a world size of its own.

Under a process group of more than one rank the world size is the group's; a
``world_size`` the options give that is another number is refused, since
figures and shards for one count of ranks cannot come from a run on another.
In one process, the options' ``world_size`` (else
:data:`~dcsched.costmodels.options.DEFAULT_WORLD_SIZE`) is modelled.

>>> from dcsched.costmodels import ProfileOptions, build
>>> options = ProfileOptions(cost_model="analytic", gpu="h100")
>>> topology = resolve_topology(options, build(options), group_size=2, local_size=2)
>>> topology.world_size, topology.nodes, topology.process_group, topology.link.latency_us
(2, 1, True, 15.0)
>>> resolve_topology(options, build(options), group_size=1).describe()
'world size 8, h100, 1 node: NVLink 4 / NVSwitch'
>>> resolve_topology(dataclasses.replace(options, world_size=8), build(options), group_size=2)
Traceback (most recent call last):
...
dcsched.errors.OptionError: world_size is 8 but this run's process group has 2 ranks: leave `world_size` out under a process group (its size is taken) or launch 8 ranks
"""  # noqa: E501

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Protocol

from dcsched.costmodels.interconnects import GPUS_PER_NODE, Link
from dcsched.errors import OptionError

if TYPE_CHECKING:
    from dcsched.costmodels.options import ProfileOptions


class Costing(Protocol):
    """What :func:`resolve_topology` asks a cost model (:class:`~dcsched.costmodels.base.CostModel` has both)."""

    def interconnect_kind(self, options: ProfileOptions) -> str: ...

    def comm_link(self, options: ProfileOptions, world_size: int, ranks_per_node: int = GPUS_PER_NODE) -> Link: ...


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where a profile's figures are for: ranks, nodes, the interconnect and whether a process group runs here."""

    #: Ranks the parameters are sharded over and every collective spans.
    world_size: int
    #: Ranks on one node (one NVLink / NVSwitch domain); more ranks cross the network.
    ranks_per_node: int
    #: The interconnect table's row (:data:`~dcsched.costmodels.interconnects.INTERCONNECTS`): ``h100``, ``cpu``, ...
    device_kind: str
    #: Latency and bus bandwidth a modelled collective is costed with (the table's, or the options' figures).
    link: Link
    #: A process group of ``world_size`` ranks runs here: a model that runs the step measures its collectives.
    process_group: bool

    @property
    def nodes(self) -> int:
        """Nodes the ranks span."""
        return math.ceil(self.world_size / self.ranks_per_node)

    def describe(self) -> str:
        """``world size 2 (the process group's), h100, 1 node: NVLink 4 / NVSwitch``."""
        whose = " (the process group's)" if self.process_group else ""
        return f"world size {self.world_size}{whose}, {self.link.name}"


def resolve_topology(options: ProfileOptions, model: Costing, *, group_size: int,
                     local_size: int | None = None) -> Topology:
    """The topology of a profile with ``options`` and ``model`` when this process's group has ``group_size`` ranks.

    Parameters
    ----------
    options : ProfileOptions
        ``world_size`` (None: the group's size, else the default), ``latency_us`` and ``bandwidth_gbps``.
    model : Costing
        The cost model: its :meth:`~dcsched.costmodels.base.CostModel.interconnect_kind` names the table's row,
        its :meth:`~dcsched.costmodels.base.CostModel.comm_link` gives the link.
    group_size : int
        Ranks of the process group running here; 1 where there is none.
    local_size : int or None
        Ranks on this node under the group (torchrun's ``LOCAL_WORLD_SIZE``); None where unknown.

    Raises
    ------
    OptionError
        ``world_size`` that disagrees with a process group of more than one rank, or below 1.
    """
    from dcsched.costmodels.options import DEFAULT_WORLD_SIZE

    asked = options.world_size
    if asked is not None and asked < 1:
        raise OptionError("world_size", "must be at least 1")
    grouped = group_size > 1
    if grouped and asked is not None and asked != group_size:
        raise OptionError("world_size", f"is {asked} but this run's process group has {group_size} ranks: leave "
                                        f"`world_size` out under a process group (its size is taken) or launch "
                                        f"{asked} ranks")
    world = group_size if grouped else (asked if asked is not None else DEFAULT_WORLD_SIZE)
    # In one process the modelled ranks sit on HGX boards of 8; a group's ranks per node are its launcher's.
    per_node = local_size if grouped and local_size is not None and local_size >= 1 else min(world, GPUS_PER_NODE)
    return Topology(world, per_node, model.interconnect_kind(options), model.comm_link(options, world, per_node),
                    grouped)
