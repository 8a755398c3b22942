"""How ``dcsched train`` and :func:`dcsched.backend` train: :class:`TrainOptions` and :class:`ScriptOptions`.

This module imports no torch (the schedulers and cost models only when
options are checked), so the command line reads its defaults and help from
here without paying for torch.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import TYPE_CHECKING, Any, Mapping

from dcsched.budget import BUDGET_SCOPE_HELP
from dcsched.collective_issue import FSDP2, FSDP2_ON_GLOO, PROCESS_GROUP, CollectiveIssue
from dcsched.costmodels.options import CostOptions, ProfileOptions, help_field, with_default
from dcsched.errors import DcschedError, OptionError
from dcsched.plan import MERGED_OVERLAP_OPTION, REPLICATE_OPTION, STAGING_OPTION

if TYPE_CHECKING:
    from dcsched.budget import Budget
    from dcsched.schedulers.registry import SchedulerInfo

#: The scheduler training runs when none is named: the step planner, within the default budget (on the CPU FSDP2's
#: peak, :meth:`TrainOptions.budget`), so a user gets the plan without asking for it.
DEFAULT_ALGO = "overlap-plan"
#: The process-group timeout when none is given, in seconds.
DEFAULT_TIMEOUT_S = 120.0
#: The range a timeout must lie in (seconds): a heartbeat takes a few milliseconds; c10d keeps its timeouts in
#: milliseconds and overflows far above a week.
TIMEOUT_RANGE_S = (0.1, 7 * 24 * 3600.0)


#: The dtype names ``dcsched train --param-dtype`` and alike take, each with the torch attribute it names.
DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
               "fp32": "float32", "float32": "float32", "fp64": "float64", "float64": "float64"}
#: What the mixed-precision flags mean (``dcsched train --param-dtype/--reduce-dtype/--output-dtype``).
DTYPE_HELP = {
    "param_dtype": "Mixed precision (FSDP2's MixedPrecisionPolicy): gather the parameters and compute in this dtype "
                   "(bf16, fp16, fp32, fp64), the shards staying in theirs (the optimizer's master weights); "
                   "floating inputs of the compiled module are cast to it. Default: each parameter's own dtype.",
    "reduce_dtype": "Mixed precision: reduce the gradients in this dtype (they land in the shards' dtype). "
                    "Default: --param-dtype.",
    "output_dtype": "Mixed precision: cast the compiled module's floating outputs to this dtype. Default: none.",
}


#: What training's memory budget option means (``dcsched train --memory-budget``, ``dcsched.backend``).
TRAIN_BUDGET_HELP = ("Memory budget for the schedulers that take one, in bytes with an optional SI/IEC suffix "
                     "(40GiB, 1.5GB), 'unlimited', or 'fsdp' (the peak FSDP2's policy takes on the step, by the "
                     "simulator). Default: the target device's memory less 10%; where none is known (the CPU), "
                     "'fsdp' for overlap-plan and unlimited for the others.")


@dataclasses.dataclass(frozen=True)
class TrainOptions(CostOptions):
    """How :func:`dcsched.backend` schedules and runs every graph it compiles.

    Every field's help is in its ``metadata["help"]``; ``dcsched train`` takes its defaults and help from
    there. The cost model's fields are :class:`~dcsched.costmodels.options.CostOptions`', declared once for
    ``dcsched profile`` and here; only ``iters`` and ``warmup`` default otherwise (see below).

    Parameters
    ----------
    algo : str
        The scheduler, a name from :func:`dcsched.schedulers.available`; default :data:`DEFAULT_ALGO`
        (``overlap-plan``).
    memory_budget : float or int or str or None
        Memory budget for the schedulers that take one: bytes, a size such as ``'40GiB'``, ``'unlimited'``,
        or ``'fsdp'`` (the peak FSDP2's policy takes on the step, by the simulator); by default the target
        device's memory less 10%, where none is known ``'fsdp'`` for a step planner (``overlap-plan``) and
        unlimited for the others.
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
        Timed and untimed runs per node of the compile-time profile (measured cost model): 5 and 1; the
        figures are then made steady (:func:`dcsched.profile.steady.steady_figures`) before any plan.
    bandwidth_gbps, latency_us : float or None
        Collective bus bandwidth (GB/s) and latency (us) of the compile-time profile's modelled
        collectives (one process; under a process group they are measured); None: the interconnect
        table's (:func:`dcsched.costmodels.interconnect`).
    compute : str
        How the scheduled graphs run: ``eager`` or ``inductor``.
    plan : str or os.PathLike or None
        A plan file (:mod:`dcsched.train.stored_plan`): the first compile stores its plan there where the file
        is absent, and reuses the stored one (no profile, no scheduler) where it was made for the same step.

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

    # A compile-time profile runs on every compile of a training run, before its first step: the median of 5 timed
    # runs after one untimed per node (a node slowed once by a busy machine does not move it; the runs cost well
    # under a second of a step's compile), where ``dcsched profile`` (5 after 2) runs once, ahead of time.
    iters: int = with_default(CostOptions, "iters", 5)
    warmup: int = with_default(CostOptions, "warmup", 1)
    algo: str = help_field(DEFAULT_ALGO, "Scheduler for every compiled graph (an unknown name lists them all); "
                                        "default overlap-plan, the step planner, within the default budget.")
    memory_budget: float | int | str | None = help_field(None, TRAIN_BUDGET_HELP)
    budget_scope: str | None = help_field(None, BUDGET_SCOPE_HELP)
    algo_options: Mapping[str, Any] = dataclasses.field(
        default_factory=dict,
        metadata={"help": "Further options of the scheduler by name (e.g. k=3 for prefetch-ahead)."})
    plan: str | os.PathLike | None = help_field(
        None, "A plan file: where absent, the first compile's plan (a bundle with its plans) is stored there; where "
              "it holds the plan of the same step (graphs, world size, scheduler and its options), that plan is run "
              "without profiling or planning; a file made for another job is refused, naming what changed.")
    compute: str = help_field("eager", "How the scheduled graphs run: eager (aten ops one by one in the schedule's "
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
        accepted = self.scheduler.options  # raises for an unknown name
        from dcsched.train.inductor import COMPUTE_MODES
        if self.compute not in COMPUTE_MODES:
            raise DcschedError(f"unknown compute {self.compute!r}: choose one of {', '.join(COMPUTE_MODES)}")
        if self.budget_scope is not None:
            from dcsched.budget import check_scope
            check_scope(self.budget_scope)
        # Read first (given_budget, once): an unreadable budget stops the run before the refusal below.
        budget_given = self.fsdp_budget or self.given_budget is not None
        schedulers.check_budget_taken([self.scheduler], memory_budget=budget_given,
                                      budget_scope=self.budget_scope is not None)
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

    def scheduler_options(self, device: str | None = None, issue: CollectiveIssue = PROCESS_GROUP) -> dict[str, Any]:
        """``algo_options`` as training runs the scheduler on ``device`` (the profile's: ``'cpu'``, ``'cuda'``),
        its collectives issued at fastest as ``issue`` says (:func:`dcsched.train.backend.fastest_issue`).

        A scheduler that may replicate parameters on its own (``overlap-plan``'s ``replicate_max_bytes``)
        replicates none, since the module's shards are cut before any plan (``--replicate-below`` decides what
        is whole). On the CPU ``overlap-plan`` keeps within buckets (``merged_overlap`` False unless given):
        gloo's collectives take CPU from the compute, which the simulator does not charge. On gloo
        (``issue.staging``) its budget counts gloo's staging copies (``staging`` True unless given).

        Examples
        --------
        >>> TrainOptions(algo="overlap-plan").scheduler_options()
        {'replicate_max_bytes': 0}
        >>> TrainOptions(algo="overlap-plan").scheduler_options("cpu")
        {'replicate_max_bytes': 0, 'merged_overlap': False}
        >>> from dcsched.collective_issue import GLOO
        >>> TrainOptions(algo="overlap-plan").scheduler_options("cpu", GLOO)
        {'replicate_max_bytes': 0, 'merged_overlap': False, 'staging': True}
        >>> TrainOptions(algo="prefetch-ahead", algo_options={"k": 2}).scheduler_options("cpu", GLOO)
        {'k': 2}
        """
        options = dict(self.algo_options)
        takes = self.scheduler.options
        if REPLICATE_OPTION in takes:
            options[REPLICATE_OPTION] = 0
        if MERGED_OVERLAP_OPTION in takes and device == "cpu":
            options.setdefault(MERGED_OVERLAP_OPTION, False)
        if STAGING_OPTION in takes and issue.staging:
            options.setdefault(STAGING_OPTION, True)
        return options

    def profile_options(self, world_size: int) -> ProfileOptions:
        """The options of the profile a compile runs before it schedules, for ``world_size`` ranks."""
        return ProfileOptions(**self.cost_options(), world_size=world_size, progress=False)

    def budget(self, bundle, *, issue: CollectiveIssue = PROCESS_GROUP) -> Budget | None:
        """The budget to schedule ``bundle`` with: the one given, else the one default rule's.

        The default rule is :func:`dcsched.budget.budget_for`'s: the target device's memory recorded in the
        bundle less 10%, else no limit; except that a step planner (``overlap-plan``) given no budget where
        no device's memory is recorded (the CPU) plans within ``'fsdp'``, the peak of FSDP2's policy on the step
        (:func:`dcsched.schedulers.fsdp.peak.fsdp_peak`, its collectives run as FSDP2 runs them, on gloo where
        ``issue.staging``): training needs no more memory than the sharding it replaces unless told it may, and a
        step planner always finds a plan within it (``fsdp``'s own).

        Parameters
        ----------
        bundle : Bundle
            The profiled bundle (its provenance may record the device's memory).
        issue : CollectiveIssue, optional
            The fastest way the step's process group issues its collectives
            (:func:`dcsched.train.backend.fastest_issue`): on gloo (``staging``) FSDP2's peak is taken as
            FSDP2 runs there (:data:`~dcsched.collective_issue.FSDP2_ON_GLOO`), else
            :data:`~dcsched.collective_issue.FSDP2`.

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
        schedulers.check_budget_taken([self.scheduler], memory_budget=self.memory_budget is not None,
                                      budget_scope=self.budget_scope is not None)
        if not self.scheduler.takes_budget:
            return None
        if self.fsdp_budget or self._fsdp_by_default(bundle):
            from dcsched.budget import DEFAULT_SCOPE, Budget, check_scope
            from dcsched.schedulers.fsdp.peak import fsdp_peak
            from dcsched.sim.collectives import latency_from_provenance
            scope = DEFAULT_SCOPE if self.budget_scope is None else check_scope(self.budget_scope)
            peak = fsdp_peak({name: bundle.form(name) for name in bundle.graph_names}, scope=scope,
                             issue=FSDP2_ON_GLOO if issue.staging else FSDP2,
                             comm_latency_ms=latency_from_provenance(bundle.provenance))
            return Budget(peak, scope)
        return budget_for(self.given_budget, bundle, scope=self.budget_scope)

    def _fsdp_by_default(self, bundle) -> bool:
        """Whether no budget was given to a step planner, with no device's memory recorded in ``bundle``."""
        from dcsched.budget import device_memory
        return self.memory_budget is None and self.scheduler.step and device_memory(bundle) is None

    @functools.cached_property
    def scheduler(self) -> SchedulerInfo:
        """The scheduler ``algo`` names, looked up once (:func:`dcsched.schedulers.get`); what the compile runs.

        Raises
        ------
        ScheduleError
            For an unknown name (the message lists the available ones).

        Examples
        --------
        >>> TrainOptions(algo="overlap-plan").scheduler.step
        True
        """
        from dcsched import schedulers  # torch, only when a compile (or a check) needs the scheduler
        return schedulers.get(self.algo)

    @property
    def fsdp_budget(self) -> bool:
        """Whether ``memory_budget`` names the peak of FSDP2's policy (``'fsdp'``)."""
        from dcsched.budget import names_fsdp_budget
        return names_fsdp_budget(self.memory_budget)

    @functools.cached_property
    def given_budget(self) -> Budget | None:
        """The budget given as ``memory_budget`` (bytes, '40GiB', 'unlimited'), read once; None when none was.

        Raises
        ------
        OptionError
            For a value that is not a budget, or an unknown ``budget_scope``.
        """
        if self.memory_budget is None or self.fsdp_budget:
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
    param_dtype, reduce_dtype, output_dtype : str, optional
        Mixed precision (``dcsched.shard(..., mp_policy=...)``, :mod:`dcsched.train.mixed_precision`), dtypes
        by name (:data:`DTYPE_NAMES`): gather and compute in ``param_dtype``, reduce in ``reduce_dtype``, cast
        outputs to ``output_dtype``. None (default): each parameter's own dtype.

    Raises
    ------
    OptionError
        From :meth:`check`: ``timeout_s`` out of range, a negative ``replicate_below``, a dtype name not in
        :data:`DTYPE_NAMES`, or :meth:`TrainOptions.check`'s.

    Examples
    --------
    >>> ScriptOptions(timeout_s=0).check()
    Traceback (most recent call last):
    ...
    dcsched.errors.OptionError: timeout_s must be between 0.1 and 604800 seconds (a week), not 0
    """

    train: TrainOptions = help_field(TrainOptions(), "The backend's options.")
    measure: bool = help_field(False, "Time every step and track the first one's peak memory, for a report.")
    timeout_s: float = help_field(DEFAULT_TIMEOUT_S, "Seconds: the process-group timeout under torchrun, and how long "
                                                 "a rank may miss heartbeats before the others stop, naming it.")
    replicate_below: int = help_field(0, "Keep every trainable parameter of fewer elements whole on every rank (no "
                                     "all-gather; its gradient all-reduced), as DeepSpeed's "
                                     "stage3_param_persistence_threshold does; 0: shard every one.")
    param_dtype: str | None = help_field(None, DTYPE_HELP["param_dtype"])
    reduce_dtype: str | None = help_field(None, DTYPE_HELP["reduce_dtype"])
    output_dtype: str | None = help_field(None, DTYPE_HELP["output_dtype"])

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
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            name = getattr(self, field)
            if name is not None and (not isinstance(name, str) or name.lower() not in DTYPE_NAMES):
                raise OptionError(field, f"must be one of {', '.join(DTYPE_NAMES)}, not {name!r}")
