"""``overlap-plan``: dcsched's bucketed planner (``docs/schedulers.md``), in the files of its steps.

:mod:`~dcsched.schedulers.overlap_plan.scheduler` is the registered algorithm;
:mod:`~dcsched.schedulers.overlap_plan.candidates` builds and simulates each graph's candidates,
:mod:`~dcsched.schedulers.overlap_plan.head_pieces` cuts the head's gathers,
:mod:`~dcsched.schedulers.overlap_plan.refine` tries cuts and merges,
:mod:`~dcsched.schedulers.overlap_plan.splice` makes each try from its candidate at the cost of what changed,
:mod:`~dcsched.schedulers.overlap_plan.replicate` keeps the head replicated where the budget allows, and
:mod:`~dcsched.schedulers.overlap_plan.coalesce` merges buckets where the step is no slower.
"""

from dcsched.schedulers.overlap_plan.scheduler import overlap_plan  # noqa: F401  (importing registers it)
