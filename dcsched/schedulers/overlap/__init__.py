"""``overlap``: dcsched's memory-budgeted overlap scheduler, in the files of its steps (``docs/overlap.md``).

:mod:`~dcsched.schedulers.overlap.scheduler` is the registered algorithm;
:mod:`~dcsched.schedulers.overlap.skeleton` takes fast-free's order apart,
:mod:`~dcsched.schedulers.overlap.sink` sinks side branches,
:mod:`~dcsched.schedulers.overlap.planner` places each gather within the budget,
with :mod:`~dcsched.schedulers.overlap.placement` and
:mod:`~dcsched.schedulers.overlap.maxtree` as its data structures.
"""

from dcsched.schedulers.overlap.scheduler import overlap  # noqa: F401  (importing registers the algorithm)
