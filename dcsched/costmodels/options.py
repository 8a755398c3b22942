"""How to profile: :class:`ProfileOptions`, the options every cost model is built from.

:class:`CostOptions` declares the cost model's options once, for a profile
(:class:`ProfileOptions`, ``dcsched profile``) and for training's compile-time
profile (:class:`dcsched.train.options.TrainOptions`, ``dcsched train``);
:func:`help_field` is the one way an options dataclass declares a field with
its help. This module imports neither torch nor the cost models themselves
(only when :meth:`ProfileOptions.check` runs), so the command line reads its
defaults and help from here without paying for torch.
"""

from __future__ import annotations

import dataclasses
import os

from dcsched.errors import OptionError


#: Ranks a profile in one process models when no ``world_size`` is given (one HGX / DGX board).
DEFAULT_WORLD_SIZE = 8


def help_field(default, help: str, **kwargs):
    """A dataclass field with its default and its one-line help (``metadata["help"]``, read by the CLI).

    Examples
    --------
    >>> help_field(3, "Three.").metadata["help"]
    'Three.'
    """
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


def with_default(cls, name: str, default):
    """Dataclass ``cls``'s field ``name`` with another ``default`` (the same help), for a subclass.

    Examples
    --------
    >>> field = with_default(CostOptions, "iters", 1)
    >>> field.default, field.metadata["help"]
    (1, 'Timed runs per node (the median is kept; measured cost model).')
    """
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return help_field(default, field.metadata["help"])


@dataclasses.dataclass(frozen=True)
class CostOptions:
    """The cost model's options: what a profile and training's compile-time profile both take.

    :class:`ProfileOptions` adds what a profile alone takes; training
    (:class:`dcsched.train.options.TrainOptions`) runs fewer timed runs per node.
    The fields are documented in :class:`ProfileOptions`.
    """

    cost_model: str = help_field(
        "measured", "Costs the nodes are given: measured (every node run and timed here), analytic (compute time "
                    "estimated for ``gpu`` from FLOPs and bytes, a roofline; nothing run) or calibrated (the "
                    "analytic estimate times per-op-kind factors from a calibration file, dcsched profile "
                    "--calibration).")
    iters: int = help_field(5, "Timed runs per node (the median is kept; measured cost model).")
    warmup: int = help_field(2, "Untimed runs per node before timing (measured cost model).")
    bandwidth_gbps: float | None = help_field(
        None, "Collective bus bandwidth in GB/s (10^9 bytes/s) of the modelled collectives (all but the measured "
              "cost model's under a process group, which are measured); default: from the interconnect table for "
              "``gpu`` and the world size: NVLink within 8 GPUs, InfiniBand across nodes, gloo on the CPU.")
    latency_us: float | None = help_field(
        None, "Per-collective latency in microseconds of the modelled collectives; default: from the interconnect "
              "table for ``gpu`` and the world size.")
    gpu: str | None = help_field(None, "Target GPU: h100, a100 or h200. Needed by ``cost_model`` analytic; also sets "
                                       "the target device memory recorded in the bundle and the interconnect "
                                       "collectives are modelled on.")

    def cost_options(self) -> dict:
        """The :class:`CostOptions` fields by name, as given (to build a :class:`ProfileOptions` from them).

        Examples
        --------
        >>> CostOptions(gpu="h100").cost_options()["gpu"]
        'h100'
        """
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(CostOptions)}


@dataclasses.dataclass(frozen=True)
class ProfileOptions(CostOptions):
    """How :func:`~dcsched.profile.measure.profile_bundle` obtains each node's figures.

    Times are in milliseconds, bandwidth in GB/s (10^9 bytes/s), latency in
    microseconds. Every field's help is in its ``metadata["help"]``
    (``dataclasses.fields(ProfileOptions)``); ``dcsched profile`` takes its
    defaults and help from there.

    Parameters
    ----------
    cost_model : str
        A name from :func:`dcsched.costmodels.available` (``measured``, ``analytic``, ``calibrated``).
    iters : int
        Timed runs per node; the median is kept (measured model). At least 1.
    warmup : int
        Untimed runs per node before timing (measured model). Not negative.
    world_size : int or None
        Ranks the parameters are sharded over, for shard sizes and the communication model. At least 1.
        None: the process group's size under one of more than one rank, else :data:`DEFAULT_WORLD_SIZE`.
        Under such a group another number is refused (:func:`~dcsched.costmodels.topology.resolve_topology`).
    bandwidth_gbps : float or None
        Collective (bus) bandwidth in GB/s for the communication model. Positive. None: the interconnect
        table's figure for the GPU kind and ``world_size`` (:func:`dcsched.costmodels.interconnect`).
    latency_us : float or None
        Per-collective latency in microseconds for the communication model. Not negative. None: the
        interconnect table's figure, as for ``bandwidth_gbps``.
    gpu : str or None
        Target GPU (``h100``, ``a100``, ``h200``): needed by the analytic model; with a measured profile
        it only names the target device's memory.
    device : str or None
        Where a measured profile runs: default CUDA if available, else the CPU.
    progress : bool
        Show a progress bar on stderr.
    calibration : str or os.PathLike or None
        A calibration file (JSON, :class:`dcsched.costmodels.Calibration`) for the calibrated model;
        with the analytic model it selects the calibrated one.

    Raises
    ------
    OptionError
        From :meth:`check` (and so from :func:`~dcsched.profile.measure.profile_bundle`), naming the field.

    Examples
    --------
    >>> ProfileOptions(cost_model="analytic", gpu="h100").world_size is None  # the group's size, else 8
    True
    >>> ProfileOptions(iters=0).check()
    Traceback (most recent call last):
    ...
    dcsched.errors.OptionError: iters must be at least 1
    """

    world_size: int | None = help_field(
        None, f"Ranks the parameters are sharded over, for shard sizes and the communication model (default: the "
              f"process group's size under torchrun, else {DEFAULT_WORLD_SIZE}; under torchrun another number is "
              f"refused).")
    device: str | None = help_field(None, "Where a measured profile runs (default: CUDA if available, else the CPU).")
    progress: bool = help_field(True, "Show a progress bar (on stderr).")
    calibration: str | os.PathLike | None = help_field(
        None, "Calibration file (JSON: measured/analytic factors by op kind, written by benchmarks/gpu_check.sh); "
              "with ``cost_model`` analytic or calibrated.")

    def check(self) -> None:
        """Refuse options no profile can use, before anything runs.

        Raises
        ------
        OptionError
            A value out of range, an unknown GPU or cost model, a calibration file the cost model cannot take;
            ``option`` is the field's name.
        """
        from dcsched.costmodels.formulas import GPUS  # torch, only when options are checked
        from dcsched.costmodels.registry import build
        if self.gpu is not None and self.gpu.lower() not in GPUS:
            raise OptionError("gpu", f"names an unknown GPU {self.gpu!r} (choose from {', '.join(GPUS)})")
        if self.iters < 1:
            raise OptionError("iters", "must be at least 1")
        if self.warmup < 0:
            raise OptionError("warmup", "must not be negative")
        if self.world_size is not None and self.world_size < 1:
            raise OptionError("world_size", "must be at least 1")
        if self.bandwidth_gbps is not None and not self.bandwidth_gbps > 0:
            raise OptionError("bandwidth_gbps", "must be positive (GB/s)")
        if self.latency_us is not None and not self.latency_us >= 0:
            raise OptionError("latency_us", "must not be negative (us)")
        build(self)
