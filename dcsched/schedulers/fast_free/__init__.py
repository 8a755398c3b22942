"""``fast-free``: DeepSpeed's memory-freeing list scheduler, exact and fast (``docs/schedulers.md``).

:mod:`~dcsched.schedulers.fast_free.scheduler` is the registered algorithm;
:mod:`~dcsched.schedulers.fast_free.groups` weighs a fan-in's gathers as one candidate,
:mod:`~dcsched.schedulers.fast_free.free_costs` sums the bytes each candidate would free, and
:mod:`~dcsched.schedulers.fast_free.gather_sets` keeps each node's all-gather ancestors packed.
"""

from dcsched.schedulers.fast_free.scheduler import fast_free  # noqa: F401  (importing registers the algorithm)
