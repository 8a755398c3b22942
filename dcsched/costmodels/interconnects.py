"""What one all-gather or reduce-scatter costs on a GPU kind's interconnect: a table of published figures.

The communication model (:func:`dcsched.costmodels.formulas.comm_time_ms`)
costs a collective over W ranks as ``latency + bytes * (W - 1) / W /
bandwidth``. That ``bandwidth`` is what ``nccl-tests`` calls the *bus
bandwidth* of an all-gather or reduce-scatter (its ``busbw`` column is
``bytes / time * (W - 1) / W``), so the figures below are bus bandwidths read
from NCCL benchmarks where they were published, not link peaks.

A node holds :data:`GPUS_PER_NODE` GPUs (an HGX / DGX board) unless the run's
topology says otherwise (torchrun's ``LOCAL_WORLD_SIZE``,
:mod:`dcsched.costmodels.topology`). Up to that many ranks talk over the
node's NVLink / NVSwitch; more ranks span ``ceil(W / ranks per node)`` nodes
and each step of the ring crosses the network, whose
per-GPU NIC is then the narrowest link. The latency across nodes grows with
the number of nodes: ``latency_us + per_doubling_us * log2(nodes)`` (NCCL
picks ring or tree depending on size; a small message's time grows about
with the depth of the tree). The ``cpu`` row is gloo (the process-group
backend of CPU runs) over TCP, at every world size.

Every figure is a round number of the order the source reports, not a
measurement of a particular machine: the measured cost model under
``torchrun`` measures the real collectives instead, and ``ProfileOptions(latency_us=...,
bandwidth_gbps=...)`` (``dcsched profile --latency --bandwidth``) override
the table.

>>> link = interconnect("h100", 8)
>>> link.latency_us, link.bandwidth_gbps, link.name
(15.0, 360.0, 'h100, 1 node: NVLink 4 / NVSwitch')
>>> interconnect("h100", 64).latency_us  # 8 nodes: 3 doublings of 10 us over the base 15 us
45.0
"""

from __future__ import annotations

import dataclasses
import math

from dcsched.errors import OptionError

#: GPUs on one node's NVLink / NVSwitch (HGX and DGX boards): more ranks cross the network.
GPUS_PER_NODE = 8


@dataclasses.dataclass(frozen=True)
class Fabric:
    """One row of :data:`INTERCONNECTS`: a network's collective figures and where they come from."""

    #: What carries the collective, e.g. ``NVLink 4 / NVSwitch``.
    name: str
    #: Per-collective latency (us) of a small message; across nodes, at 1 node's worth of depth.
    latency_us: float
    #: All-gather / reduce-scatter bus bandwidth in GB/s (10^9 bytes/s) for large messages.
    bandwidth_gbps: float
    #: The published figures (or the reasoning) behind the numbers.
    source: str
    #: Latency added per doubling of the number of nodes (us); 0 within a node.
    per_doubling_us: float = 0.0


@dataclasses.dataclass(frozen=True)
class Link:
    """The figures one profile's modelled collectives use, and which row (or option) gave them.

    ``name`` says which row of :data:`INTERCONNECTS` (``h100, 4 nodes: InfiniBand NDR ...``), or ``given``
    when both figures were given as options; ``source`` names the published figures behind the row.
    """

    latency_us: float
    bandwidth_gbps: float
    source: str
    name: str


_NVLINK4 = ("nccl-tests all_gather / reduce_scatter busbw on 8x H100 SXM (NVLink 4, NVSwitch), ring: about "
            "350-370 GB/s of the 450 GB/s per direction peak; small-message time 10-20 us")
_NDR = ("8x ConnectX-7 InfiniBand NDR 400 Gb/s per node, one NIC per GPU: 46-48 GB/s per NIC in nccl-tests "
        "(NVIDIA/nccl-tests#290); small-message all_reduce about 60-70 us at 32 nodes (NVIDIA/nccl#652)")

#: GPU kind (the keys of :data:`dcsched.costmodels.formulas.GPUS`, and ``cpu``) -> (within one node, across
#: nodes). ``cpu`` has one row for every world size (the second is None).
INTERCONNECTS: dict[str, tuple[Fabric, Fabric | None]] = {
    "h100": (Fabric("NVLink 4 / NVSwitch", 15.0, 360.0, _NVLINK4),
             Fabric("InfiniBand NDR, 8x400 Gb/s per node", 15.0, 45.0, _NDR, per_doubling_us=10.0)),
    # The H200 SXM has the H100's NVLink 4 and ships on the same 8x400 Gb/s boards (DGX H200).
    "h200": (Fabric("NVLink 4 / NVSwitch", 15.0, 360.0, _NVLINK4 + "; H200 SXM: the same NVLink 4"),
             Fabric("InfiniBand NDR, 8x400 Gb/s per node", 15.0, 45.0, _NDR, per_doubling_us=10.0)),
    "a100": (Fabric("NVLink 3 / NVSwitch", 20.0, 230.0,
                    "nccl-tests busbw on 8x A100 SXM4 (NVLink 3, NVSwitch): about 230-250 GB/s of the 300 GB/s "
                    "per direction peak; small-message time of the order of 10-20 us on one node"),
             Fabric("InfiniBand HDR, 8x200 Gb/s per node", 20.0, 23.0,
                    "DGX A100: 8x ConnectX-6 HDR 200 Gb/s (25 GB/s) per node, one per GPU, at the ~93% of line "
                    "rate NDR reaches; small-message all_reduce about 60-70 us at 32 nodes (NVIDIA/nccl#652)",
                    per_doubling_us=10.0)),
    "cpu": (Fabric("gloo over TCP", 100.0, 5.0,
                   "order of magnitude of torch.distributed's gloo backend between processes on one host "
                   "(hundreds of us per collective, a few GB/s through the loopback); not a benchmark"),
            None),
}


def interconnect(gpu: str, world_size: int, ranks_per_node: int = GPUS_PER_NODE) -> Link:
    """The collective latency and bus bandwidth of ``world_size`` ranks of GPU kind ``gpu``.

    Parameters
    ----------
    gpu : str
        A key of :data:`INTERCONNECTS` (``h100``, ``h200``, ``a100``, ``cpu``), case-insensitive.
    world_size : int
        Ranks in the collective: up to ``ranks_per_node`` within one node, more across
        ``ceil(world_size / ranks_per_node)`` nodes.
    ranks_per_node : int
        Ranks on one node's NVLink / NVSwitch: :data:`GPUS_PER_NODE` (an HGX board) unless a launch says.

    Returns
    -------
    Link
        ``latency_us``, ``bandwidth_gbps`` (GB/s), ``source`` (the published figures) and ``name`` (the row).

    Raises
    ------
    OptionError
        An unknown GPU kind (``gpu``), a world size or ranks per node below 1.

    Examples
    --------
    >>> interconnect("a100", 4).bandwidth_gbps, interconnect("a100", 16).bandwidth_gbps
    (230.0, 23.0)
    >>> interconnect("H100", 16).name
    'h100, 2 nodes: InfiniBand NDR, 8x400 Gb/s per node'
    >>> interconnect("cpu", 64).latency_us
    100.0
    """
    kind = gpu.lower()
    if kind not in INTERCONNECTS:
        raise OptionError("gpu", f"names no interconnect {gpu!r} (choose from {', '.join(INTERCONNECTS)})")
    if world_size < 1:
        raise OptionError("world_size", "must be at least 1")
    if ranks_per_node < 1:
        raise OptionError("ranks_per_node", "must be at least 1")
    within, across = INTERCONNECTS[kind]
    nodes = math.ceil(world_size / ranks_per_node)
    if across is None:
        return Link(within.latency_us, within.bandwidth_gbps, within.source, f"{kind}: {within.name}")
    if nodes == 1:
        return Link(within.latency_us, within.bandwidth_gbps, within.source, f"{kind}, 1 node: {within.name}")
    latency = across.latency_us + across.per_doubling_us * math.log2(nodes)
    return Link(latency, across.bandwidth_gbps, across.source, f"{kind}, {nodes} nodes: {across.name}")


def resolve(gpu: str, world_size: int, *, latency_us: float | None = None,
            bandwidth_gbps: float | None = None, ranks_per_node: int = GPUS_PER_NODE) -> Link:
    """The table's :class:`Link` for ``gpu`` and ``world_size``, with the figures given (not None) in its place.

    Parameters
    ----------
    gpu, world_size, ranks_per_node
        As for :func:`interconnect` (checked even when both figures are given).
    latency_us, bandwidth_gbps : float or None
        Figures that replace the table's (``ProfileOptions.latency_us`` / ``bandwidth_gbps``).

    Returns
    -------
    Link
        ``name`` is ``given`` when both figures are given, else says which one was and which row gave the other.

    Examples
    --------
    >>> link = resolve("h100", 8, latency_us=5.0, bandwidth_gbps=50.0)
    >>> link.latency_us, link.bandwidth_gbps, link.name
    (5.0, 50.0, 'given')
    >>> resolve("h100", 8, latency_us=5.0).name
    'given latency; bandwidth from h100, 1 node: NVLink 4 / NVSwitch'
    """
    link = interconnect(gpu, world_size, ranks_per_node)
    if latency_us is not None and bandwidth_gbps is not None:
        return Link(float(latency_us), float(bandwidth_gbps), "given", "given")
    if latency_us is not None:
        return dataclasses.replace(link, latency_us=float(latency_us),
                                   name=f"given latency; bandwidth from {link.name}")
    if bandwidth_gbps is not None:
        return dataclasses.replace(link, bandwidth_gbps=float(bandwidth_gbps),
                                   name=f"given bandwidth; latency from {link.name}")
    return link


def kind_of_device(device_name: str) -> str | None:
    """The :data:`INTERCONNECTS` key a device's name is of, or None: ``NVIDIA H100 80GB HBM3`` -> ``h100``.

    >>> kind_of_device("cpu (x86_64, 2 threads)"), kind_of_device("cuda:0 (NVIDIA A100-SXM4-80GB)")
    ('cpu', 'a100')
    >>> kind_of_device("cuda:0 (NVIDIA L4)") is None
    True
    """
    text = device_name.lower()
    if text.startswith("cpu"):
        return "cpu"
    return next((kind for kind in INTERCONNECTS if kind != "cpu" and kind in text), None)
