"""What a report format is given: the report of one ``dcsched schedule`` run, as plain data.

Two kinds of report. :class:`ScheduleReport` holds a
:class:`dcsched.report.compare.Comparison` (every graph's simulated figures before and
after each algorithm) and where the run wrote things; :class:`SweepReport`
holds ``--sweep``'s trade-off curves (:class:`dcsched.report.sweep.SweepRow` lists
per graph). A format says which kinds it renders (``ReportFormat.reports``).
Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from dcsched.bundle.saved_memory import SavedActivations
    from dcsched.report.compare import Comparison
    from dcsched.report.sweep import SweepRow
    from dcsched.sim.step_memory import StepMemory


@dataclasses.dataclass
class ScheduleReport:
    """One ``dcsched schedule`` run: the comparison and the files it wrote."""

    kind: ClassVar[str] = "schedule"
    #: the input bundle
    input: Path
    comparison: Comparison
    #: algorithm -> the reordered bundle written for it
    outputs: dict[str, Path] = dataclasses.field(default_factory=dict)
    #: format name -> path, for each file format asked for (``--trace``, ``--plot``), in the order written
    files: dict[str, Path] = dataclasses.field(default_factory=dict)
    #: per-parameter lifetimes too (``--params``)
    params: bool = False
    #: ds_id -> parameter name (from the bundle's parameter table)
    param_names: dict[int, str] = dataclasses.field(default_factory=dict)
    #: what the captured step saves for the backward, with and without its checkpointing (None: not recorded)
    saved: SavedActivations | None = None
    #: the whole step's memory per rank by kind, before (``'before'``) and under each algorithm
    #: (:func:`dcsched.sim.step_memory.compared_step_memory`; empty: not simulated)
    step_memory: dict[str, StepMemory] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class SweepReport:
    """``--sweep``: the overlap scheduler's memory / step-time curve per graph."""

    kind: ClassVar[str] = "sweep"
    input: Path
    #: what the swept budgets cap ('all' or 'gathered')
    scope: str
    #: graph name -> one row per budget, smallest first, unlimited last
    curves: dict[str, list[SweepRow]]
    files: dict[str, Path] = dataclasses.field(default_factory=dict)


Report = ScheduleReport | SweepReport
