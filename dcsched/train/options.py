"""How ``dcsched train`` and :func:`dcsched.backend` train: :class:`TrainOptions` and :class:`ScriptOptions`.

This module imports no torch (the schedulers and cost models only when
options are checked), so the command line reads its defaults and help from
here without paying for torch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Mapping

from dcsched.budget import BUDGET_SCOPE_HELP, MEMORY_BUDGET_HELP
from dcsched.costmodels.options import ProfileOptions
from dcsched.errors import DcschedError, OptionError
from dcsched.plan import MERGED_OVERLAP_OPTION, REPLICATE_OPTION

if TYPE_CHECKING:
    from dcsched.budget import Budget

#: The process-group timeout when none is given, in seconds.
DEFAULT_TIMEOUT_S = 120.0
#: The range a timeout must lie in (seconds): a heartbeat takes a few milliseconds; c10d keeps its timeouts in
#: milliseconds and overflows far above a week.
TIMEOUT_RANGE_S = (0.1, 7 * 24 * 3600.0)


def _field(default, help: str, **kwargs):
    """A dataclass field with its default and its one-line help (``metadata["help"]``, read by the CLI)."""
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """How :func:`dcsched.backend` schedules and runs every graph it compiles.

    Every field's help is in its ``metadata["help"]``; ``dcsched train`` takes its defaults and help from
    there.

    Parameters
    ----------
    algo : str
        The scheduler, a name from :func:`dcsched.schedulers.available`.
    memory_budget : float or int or str or None
        Memory budget for the schedulers that take one: bytes, a size such as ``'40GiB'``, or
        ``'unlimited'``; by default the target device's memory less 10% (unlimited where none is known).
    budget_scope : str or None
        What the budget caps, for the schedulers that take it: ``'all'`` or ``'gathered'``.
    algo_options : Mapping[str, Any]
        The scheduler's further options by name (``{"k": 2}`` for ``prefetch-ahead``); each must be one
        the scheduler takes.
    cost_model : str
        The costs the scheduler works with: ``measured`` or ``analytic``.
    gpu : str or None
        Target GPU (``h100``, ``a100``, ``h200``): needed by the analytic cost model.
    iters, warmup : int
        Timed and untimed runs per node of the compile-time profile (measured cost model).
    bandwidth_gbps, latency_us : float or None
        Collective bus bandwidth (GB/s) and latency (us) of the compile-time profile's modelled
        collectives (one process; under a process group they are measured); None: the interconnect
        table's (:func:`dcsched.costmodels.interconnect`).
    compute : str
        How the scheduled graphs run: ``eager`` or ``inductor``.

    Raises
    ------
    OptionError
        From :meth:`check`, naming the field (``algo``, ``algo_options``, ``gpu``, ...).
    DcschedError
        A memory budget that cannot be read, an unknown ``compute`` mode.

    Examples
    --------
    >>> TrainOptions(algo="prefetch-ahead", algo_options={"k": 2}).check()
    >>> TrainOptions(algo="none", algo_options={"k": 2}).check()
    Traceback (most recent call last):
    ...
    dcsched.errors.OptionError: algo_options has 'k', which scheduler 'none' does not take (taken by: prefetch-ahead)
    """

    algo: str = _field("none", "Scheduler for every compiled graph (an unknown name lists them all).")
    memory_budget: float | int | str | None = _field(None, MEMORY_BUDGET_HELP)
    budget_scope: str | None = _field(None, BUDGET_SCOPE_HELP)
    algo_options: Mapping[str, Any] = dataclasses.field(
        default_factory=dict,
        metadata={"help": "Further options of the scheduler by name (e.g. k=3 for prefetch-ahead)."})
    cost_model: str = _field("measured", "Costs the scheduler works with: measured (every node run and timed once "
                                         "here at compile time) or analytic (estimated for ``gpu``, nothing run).")
    gpu: str | None = _field(None, "Target GPU (h100, a100, h200): needed by ``cost_model`` analytic; also the "
                                   "default memory budget.")
    iters: int = _field(1, "Timed runs per node of the compile-time profile (measured cost model).")
    warmup: int = _field(1, "Untimed runs per node before timing (measured cost model).")
    bandwidth_gbps: float | None = _field(
        None, "Collective bus bandwidth in GB/s of the compile-time profile's modelled collectives (one process; "
              "measured under a process group); default: from the interconnect table for ``gpu``.")
    latency_us: float | None = _field(
        None, "Per-collective latency in microseconds of the modelled collectives; default: from the interconnect "
              "table for ``gpu``.")
    compute: str = _field("eager", "How the scheduled graphs run: eager (aten ops one by one in the schedule's "
                                   "order; measured memory matches the simulator's) or inductor (compiled by "
                                   "inductor, the ZeRO-3 ops kept in their scheduled places: plain torch.compile's "
                                   "speed; peak memory not tracked on the CPU).")

    def check(self) -> None:
        """Refuse options no compile can use, before anything runs.

        Raises
        ------
        OptionError
            An unknown scheduler (``algo``), an option the scheduler does not take, a bad profile option.
        DcschedError
            An unknown ``compute`` mode, a memory budget or budget scope that cannot be read.
        """
        from dcsched import schedulers  # torch, only when options are checked
        accepted = schedulers.get(self.algo).options  # raises for an unknown name
        from dcsched.train.inductor import COMPUTE_MODES
        if self.compute not in COMPUTE_MODES:
            raise DcschedError(f"unknown compute {self.compute!r}: choose one of {', '.join(COMPUTE_MODES)}")
        if self.given_budget is not None and "memory_budget" not in accepted:
            raise OptionError("memory_budget", f"is given, but scheduler '{self.algo}' takes no memory budget")
        if self.budget_scope is not None:
            from dcsched.budget import check_scope
            check_scope(self.budget_scope)
            if "budget_scope" not in accepted:
                raise OptionError("budget_scope", f"is given, but scheduler '{self.algo}' takes no budget scope")
        for key in self.algo_options:
            if key in ("memory_budget", "budget_scope"):
                raise OptionError("algo_options", f"has {key!r}: pass it as {key}= itself")
            if key == REPLICATE_OPTION and self.algo_options[key]:
                raise OptionError("algo_options", f"has {key!r}: training shards the module before it plans, so "
                                                  "what is whole on every rank is decided by replicate_below "
                                                  "(--replicate-below N elements)")
            if key not in accepted:
                takers = sorted(a for a in schedulers.available() if key in schedulers.get(a).options)
                who = "taken by: " + ", ".join(takers) if takers else "no scheduler takes it"
                raise OptionError("algo_options", f"has {key!r}, which scheduler '{self.algo}' does not take ({who})")
        self.profile_options(1).check()

    def scheduler_options(self, device: str | None = None) -> dict[str, Any]:
        """``algo_options`` as training runs the scheduler on ``device`` (the profile's: ``'cpu'``, ``'cuda'``).

        A scheduler that may replicate parameters on its own (``overlap-plan``'s ``replicate_max_bytes``)
        replicates none, since the module's shards are cut before any plan (``--replicate-below`` decides what
        is whole). On the CPU ``overlap-plan`` keeps within buckets (``merged_overlap`` False unless given):
        gloo's collectives take CPU from the compute, which the simulator does not charge.

        Examples
        --------
        >>> TrainOptions(algo="overlap-plan").scheduler_options()
        {'replicate_max_bytes': 0}
        >>> TrainOptions(algo="overlap-plan").scheduler_options("cpu")
        {'replicate_max_bytes': 0, 'merged_overlap': False}
        >>> TrainOptions(algo="prefetch-ahead", algo_options={"k": 2}).scheduler_options("cpu")
        {'k': 2}
        """
        from dcsched import schedulers

        options = dict(self.algo_options)
        takes = schedulers.get(self.algo).options
        if REPLICATE_OPTION in takes:
            options[REPLICATE_OPTION] = 0
        if MERGED_OVERLAP_OPTION in takes and device == "cpu":
            options.setdefault(MERGED_OVERLAP_OPTION, False)
        return options

    def profile_options(self, world_size: int) -> ProfileOptions:
        """The options of the profile a compile runs before it schedules, for ``world_size`` ranks."""
        return ProfileOptions(cost_model=self.cost_model, iters=self.iters, warmup=self.warmup,
                              world_size=world_size, gpu=self.gpu, bandwidth_gbps=self.bandwidth_gbps,
                              latency_us=self.latency_us, progress=False)

    def budget(self, bundle) -> Budget | None:
        """The budget to schedule ``bundle`` with: the one given, else the one default rule's.

        The default rule is :func:`dcsched.budget.default_budget`'s: the target device's memory recorded in the
        bundle less 10%, else no limit.

        Parameters
        ----------
        bundle : Bundle
            The profiled bundle (its provenance may record the device's memory).

        Returns
        -------
        Budget or None
            None for a scheduler that takes no budget.

        Raises
        ------
        OptionError
            For an unreadable budget or scope, or a budget given to a scheduler that takes none.
        """
        from dcsched import schedulers
        from dcsched.budget import budget_for
        if not schedulers.get(self.algo).takes_budget:
            if self.memory_budget is not None:
                raise OptionError("memory_budget", f"is given, but scheduler '{self.algo}' takes no memory budget")
            return None
        return budget_for(self.given_budget, bundle, scope=self.budget_scope)

    @functools.cached_property
    def given_budget(self) -> Budget | None:
        """The budget given as ``memory_budget`` (bytes, '40GiB', 'unlimited'), read once; None when none was.

        Raises
        ------
        OptionError
            For a value that is not a budget, or an unknown ``budget_scope``.
        """
        if self.memory_budget is None:
            return None
        from dcsched.budget import Budget
        return Budget.parse(self.memory_budget, scope=self.budget_scope)


@dataclasses.dataclass(frozen=True)
class ScriptOptions:
    """How :func:`~dcsched.train.script.train_script` trains a script.

    Parameters
    ----------
    train : TrainOptions
        The backend's options, for every module the script compiles.
    measure : bool
        Time every step and track the first one's peak memory, for a report.
    timeout_s : float
        Seconds: the process-group timeout under torchrun, and how long a rank may miss heartbeats before
        the others stop, naming it. Between 0.1 and 604800 (a week).
    replicate_below : int
        Trainable parameters of fewer elements stay whole on every rank (``dcsched.shard(...,
        replicate_below=N)``): no all-gather, their gradients all-reduced. 0 (default): every one sharded.

    Raises
    ------
    OptionError
        From :meth:`check`: ``timeout_s`` out of range, a negative ``replicate_below``, or
        :meth:`TrainOptions.check`'s.

    Examples
    --------
    >>> ScriptOptions(timeout_s=0).check()
    Traceback (most recent call last):
    ...
    dcsched.errors.OptionError: timeout_s must be between 0.1 and 604800 seconds (a week), not 0
    """

    train: TrainOptions = _field(TrainOptions(), "The backend's options.")
    measure: bool = _field(False, "Time every step and track the first one's peak memory, for a report.")
    timeout_s: float = _field(DEFAULT_TIMEOUT_S, "Seconds: the process-group timeout under torchrun, and how long "
                                                 "a rank may miss heartbeats before the others stop, naming it.")
    replicate_below: int = _field(0, "Keep every trainable parameter of fewer elements whole on every rank (no "
                                     "all-gather; its gradient all-reduced), as DeepSpeed's "
                                     "stage3_param_persistence_threshold does; 0: shard every one.")

    def check(self) -> None:
        """Refuse options no run can use (:meth:`TrainOptions.check`, then ``timeout_s``)."""
        self.train.check()
        low, high = TIMEOUT_RANGE_S
        if not low <= self.timeout_s <= high:  # nan fails both comparisons
            raise OptionError("timeout_s", f"must be between {low:g} and {high:g} seconds (a week), not "
                                           f"{self.timeout_s:g}")
        if isinstance(self.replicate_below, bool) or not isinstance(self.replicate_below, int) \
                or self.replicate_below < 0:
            raise OptionError("replicate_below", f"must be a whole number of elements, 0 or more, not "
                                                 f"{self.replicate_below!r}")
