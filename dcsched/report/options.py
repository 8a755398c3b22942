"""How ``dcsched schedule`` schedules a bundle: :class:`ScheduleOptions`, read once into a :class:`Selection`.

The command declares its options from here (defaults and help in the fields'
metadata, as :class:`~dcsched.costmodels.options.ProfileOptions` and
:class:`~dcsched.train.options.TrainOptions` do for theirs);
:meth:`ScheduleOptions.resolve` looks each scheduler up once, reads the
budget once into a :class:`~dcsched.budget.Budget` and refuses what no
selected scheduler takes, before the bundle is read. This module imports no
torch (the schedulers only when options are resolved), so ``dcsched --help``
reads it without paying for torch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

from dcsched.budget import BUDGET_SCOPE_HELP, MEMORY_BUDGET_HELP, Budget, check_scope
from dcsched.costmodels.options import help_field
from dcsched.errors import DcschedError, OptionError

if TYPE_CHECKING:
    from dcsched.schedulers.registry import SchedulerInfo

#: What ``algo`` names to select every registered scheduler.
ALL = "all"
#: The budget's options, given as fields of their own, never in ``algo_options``.
BUDGET_OPTIONS = ("memory_budget", "budget_scope")


@dataclasses.dataclass(frozen=True)
class Selection:
    """The schedulers to run and what each receives, resolved once (:meth:`ScheduleOptions.resolve`).

    Parameters
    ----------
    schedulers : tuple of SchedulerInfo
        The selected schedulers' registry entries, in the order given (registration order for ``'all'``).
    options : mapping of str to mapping
        Each scheduler's own options by its name (the budget's not among them).
    budget : Budget or None
        The budget given, read once; None: none was, and the default rule
        (:func:`dcsched.budget.budget_for`) applies once the bundle is read.
    scope : str or None
        The budget scope given (None: the default, ``'all'``).
    """

    schedulers: tuple[SchedulerInfo, ...]
    options: Mapping[str, Mapping[str, Any]]
    budget: Budget | None
    scope: str | None

    @property
    def names(self) -> list[str]:
        """The selected schedulers' names."""
        return [info.name for info in self.schedulers]

    @property
    def budgeted(self) -> list[str]:
        """The names of the selected schedulers that take a memory budget."""
        return [info.name for info in self.schedulers if info.takes_budget]


@dataclasses.dataclass(frozen=True)
class ScheduleOptions:
    """What ``dcsched schedule`` runs on a bundle.

    Every field's help is in its ``metadata["help"]``; ``dcsched schedule``
    takes its defaults and help from there.

    Parameters
    ----------
    algo : str
        A scheduler's name, a comma-separated list of them, or ``'all'`` (every registered one).
    memory_budget : str, int, float or None
        The memory budget for the schedulers that take one (:meth:`dcsched.budget.Budget.parse`); None:
        the default rule, the target device's memory less 10%.
    budget_scope : str or None
        What the budget caps: ``'all'`` or ``'gathered'``.
    algo_options : Mapping[str, Any]
        Options passed to each selected scheduler that takes them (``{"k": 3}``); each must be one some
        selected scheduler takes.
    assume_zero : bool
        Count missing ``device_time`` / ``tensor_size`` as 0 instead of refusing the graph.

    Examples
    --------
    >>> selection = ScheduleOptions(algo="overlap,fast-free", memory_budget="1GiB").resolve()
    >>> selection.names, selection.budget, selection.budgeted
    (['overlap', 'fast-free'], Budget(bytes=1073741824, scope='all'), ['overlap'])
    >>> ScheduleOptions(algo="fast-free", memory_budget="1GiB").resolve()
    Traceback (most recent call last):
    ...
    dcsched.errors.OptionError: memory_budget is given, but scheduler 'fast-free' takes no memory budget
    """

    algo: str = help_field("fast-free", "Scheduler name, a comma-separated list, or 'all' for every registered one "
                                        "(fast-free, simple-prefetch, list, overlap, none, ...; an unknown name "
                                        "lists them all).")
    memory_budget: str | int | float | None = help_field(None, MEMORY_BUDGET_HELP)
    budget_scope: str | None = help_field(None, BUDGET_SCOPE_HELP)
    algo_options: Mapping[str, Any] = dataclasses.field(
        default_factory=dict,
        metadata={"help": "KEY=VALUE passed to the selected schedulers that take KEY (repeatable; numbers converted, "
                          "true/false bools; e.g. -O k=3, -O merged-overlap=false)."})
    assume_zero: bool = help_field(False, "Count missing device_time (ms) / tensor_size (bytes) as 0 instead of "
                                          "refusing the graph.")

    def resolve(self) -> Selection:
        """The schedulers selected, each looked up once, their options, and the budget given, read once.

        Returns
        -------
        Selection

        Raises
        ------
        ScheduleError
            An unknown scheduler.
        OptionError
            An unreadable budget or scope; a budget or scope no selected scheduler takes (the one refusal,
            :func:`dcsched.schedulers.check_budget_taken`); a budget option in ``algo_options``.
        DcschedError
            No scheduler named, or an option no selected scheduler takes.
        """
        from dcsched import schedulers  # torch, only when options are resolved
        infos = _selected(self.algo)
        scope = None if self.budget_scope is None else check_scope(self.budget_scope)
        budget = None if self.memory_budget is None else Budget.parse(self.memory_budget, scope=scope)
        schedulers.check_budget_taken(infos, memory_budget=budget is not None, budget_scope=scope is not None)
        for key in self.algo_options:
            if key in BUDGET_OPTIONS:
                raise OptionError("algo_options", f"has {key!r}: pass it as {key}= itself")
            if not any(key in info.options for info in infos):
                takers = [name for name in schedulers.available() if key in schedulers.get(name).options]
                raise DcschedError(f"no selected scheduler takes option '{key}' "
                                   f"({'taken by: ' + ', '.join(takers) if takers else 'no scheduler takes it'})")
        own = {info.name: {k: v for k, v in self.algo_options.items() if k in info.options} for info in infos}
        return Selection(tuple(infos), own, budget, scope)


def _selected(algo: str) -> list[SchedulerInfo]:
    """``'all'``: every registered scheduler; else the comma-separated names, each looked up once, in order."""
    from dcsched import schedulers
    names = schedulers.available() if algo == ALL else [name.strip() for name in algo.split(",") if name.strip()]
    if not names:
        raise OptionError("algo", "needs a scheduler name or 'all'")
    return [schedulers.get(name) for name in dict.fromkeys(names)]
