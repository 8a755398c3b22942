"""The ZeRO-3 runtime: the ops a scheduled graph calls, and what executes them in one process or across ranks.

:mod:`~dcsched.runtime.ops` defines the ops and the single-process runtime,
:mod:`~dcsched.runtime.local` the world-size-1 runtime over 1-D shards,
:mod:`~dcsched.runtime.distributed` the runtime over a process group,
:mod:`~dcsched.runtime.commplan` the communication plan as the runtimes read it
(buckets of ds_ids, kept parameters), :mod:`~dcsched.runtime.buckets` a
bucket's flat layout,
:mod:`~dcsched.runtime.step` runs one step of a bundle with one of them installed,
:mod:`~dcsched.runtime.consensus` is what every rank agrees on first and
:mod:`~dcsched.runtime.memtrack` measures live tensor bytes. Replay and train
both run through here.
"""
