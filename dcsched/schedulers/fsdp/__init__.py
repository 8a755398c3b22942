"""``fsdp``: FSDP2's policy as a schedule (``docs/schedulers.md``).

:mod:`~dcsched.schedulers.fsdp.scheduler` is the registered algorithm (blocks, one bucket each, prefetched one
block ahead); :mod:`~dcsched.schedulers.fsdp.bucketing` makes an order's blocks buckets,
:mod:`~dcsched.schedulers.fsdp.waits_first` places a bucket's waits before its readers, and
:mod:`~dcsched.schedulers.fsdp.peak` simulates the policy's peak, the training budget ``'fsdp'``.
"""

from dcsched.schedulers.fsdp.scheduler import fsdp  # noqa: F401  (importing registers the algorithm)
