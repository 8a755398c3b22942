"""How a run issues its collectives: one value that the simulator, the runtime, replay, training and the
schedulers all read.

A step's graph says where each collective is issued and where it is waited on; how the process group runs
it between the two is the run's choice, and changes the memory a step takes and, where a collective blocks
the host that issues it, the step time (never the order). :class:`CollectiveIssue` names that choice; the
constants below are the ways that occur.

>>> SIMULATOR.async_gather, SIMULATOR.async_reduce, SIMULATOR.staging, SIMULATOR.blocking_in_step
(True, False, False, False)
>>> FSDP2_ON_GLOO == CollectiveIssue(async_gather=False, async_reduce=False, staging=True)
True
>>> FSDP2_ON_GLOO.blocks_step, GLOO.blocks_step, SIMULATOR.blocks_step
(True, False, False)
>>> GLOO.without_staging() == PROCESS_GROUP
True
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CollectiveIssue:
    """How a run issues its all-gathers and reduce-scatters, and whether their staging copies count.

    Each of the first three changes how long some bytes live in the simulated memory series. A blocking
    collective (``async_gather`` or ``async_reduce`` False) also holds the compute stream: the host that
    issues it waits in the call, so the compute goes on only once the collective has ended (it starts when
    the communication stream is free); the simulated step adds that wait. :data:`SIMULATOR` alone
    (``blocking_in_step`` False) times its reduce-scatters, done where they stand for the memory, on the
    communication stream as if they ran beside the compute: the model every scheduler's figures and the
    plans from files are made with.

    Attributes
    ----------
    async_gather : bool
        The all-gathers are asynchronous, waited on at their wait node (default). False: each blocks where
        it is issued (FSDP2 on gloo). The simulator reads it only where ``staging`` is on: an asynchronous
        all-gather's staging copy lives from its issue until the first wait on any of its members, a
        blocking one's at its issue alone. The runtime
        (:class:`~dcsched.runtime.distributed.DistributedZero3Runtime`) waits on a blocking all-gather
        where it issues it.
    async_reduce : bool
        The gradient reduce-scatters are asynchronous, one in flight, as a process group runs them
        (issuing the next waits on it first): a gradient whose last reader is its reduce lives until just
        before the next reduce-scatter is issued (the last one to the graph's end), and so does a reduce's
        staging copy. False (the simulator's default): each is done where it stands, its gradient freed
        there; the runtime then waits on each where it issues it.
    staging : bool
        Count gloo's staging copies (:mod:`dcsched.sim.staging`): the flat tensors gloo's collectives
        allocate for themselves while they run (an all-gather's output-sized tensor, a reduce-scatter's
        clone of its input; an all-reduce works in place). The memory series adds each for as long as
        ``async_gather`` and ``async_reduce`` say it lives. The runtime does not read it: gloo makes the
        copies whatever dcsched counts, and the per-rank memory tracker does not see them.
    blocking_in_step : bool
        Price a blocking collective on the critical path (default): the compute stream waits for it from
        its issue point until it ends (:attr:`blocks_step`). False: timed as if it ran beside the compute
        (:data:`SIMULATOR`'s model; the flags above then change the memory alone).

    Examples
    --------
    >>> CollectiveIssue(async_reduce=True).adds_memory, SIMULATOR.adds_memory
    (True, False)
    """

    async_gather: bool = True
    async_reduce: bool = False
    staging: bool = False
    blocking_in_step: bool = True

    @property
    def blocks_step(self) -> bool:
        """Whether some collective holds the compute stream in the simulated step: ``blocking_in_step`` and
        the all-gathers or the reduce-scatters blocking."""
        return self.blocking_in_step and not (self.async_gather and self.async_reduce)

    @property
    def adds_memory(self) -> bool:
        """Whether the simulated memory series differs from :data:`SIMULATOR`'s: a reduce-scatter in flight
        or staging copies (the all-gathers' asynchrony alone changes nothing without the copies)."""
        return self.async_reduce or self.staging

    def without_staging(self) -> CollectiveIssue:
        """This way of issuing with no staging copies counted: what the per-rank memory tracker sees of it."""
        return dataclasses.replace(self, staging=False)


#: The simulator's default, with which the schedulers plan and the reports compare orders: every all-gather
#: waited on at its wait node, every reduce-scatter done where it stands (for the memory; timed on the
#: communication stream beside the compute: ``blocking_in_step`` False), no staging copies.
SIMULATOR = CollectiveIssue(blocking_in_step=False)
#: The runtime's default under a process group (:class:`~dcsched.runtime.distributed.DistributedZero3Runtime`),
#: as replay and training compare their measured peaks with it: all-gathers and reduce-scatters asynchronous,
#: one reduce-scatter in flight; gloo's staging copies not counted (the memory tracker does not see them).
PROCESS_GROUP = CollectiveIssue(async_reduce=True)
#: FSDP2 on NCCL (on its own streams): asynchronous, one reduce-scatter in flight, no staging copies.
FSDP2 = PROCESS_GROUP
#: The runtime's default on a gloo process group with gloo's staging copies counted: the fastest way a
#: training step on gloo may issue its collectives within a budget (:func:`dcsched.train.backend.asynchrony`).
GLOO = CollectiveIssue(async_reduce=True, staging=True)
#: FSDP2 on gloo (``unshard_async_op`` False by default, and the CPU has no stream to run a collective beside
#: the compute): every collective blocking, gloo's staging copies counted. The least memory the runtime can
#: run a plan in on gloo, and the slowest (every collective on the critical path): ``overlap-plan``'s
#: ``staging`` option plans its peaks with it (its ``blocking`` option its step times too).
FSDP2_ON_GLOO = CollectiveIssue(async_gather=False, async_reduce=False, staging=True)
