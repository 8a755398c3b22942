"""What a scheduler returns: a :class:`Plan`, the order and what may go with it.

``order`` is every node of the graph (by name) in the order to run it.
``buckets`` groups communication nodes that the plan means to run as one
collective (``deepcompile``'s fused all-gather groups); ``residency`` says, per
parameter (``ds_id``), whether it stays sharded between uses (the default), is
kept gathered, or is replicated. ``deepcompile`` and ``fsdp`` fill ``buckets``;
the simulator runs each bucket as one collective issued at its first member
(:meth:`dcsched.sim.simulate.CompiledGraph.simulate`), and so does the runtime
(:mod:`dcsched.runtime.commplan` reads a bundle's plans; one all-gather or
reduce-scatter per bucket across processes, a reduce bucket issued when its
last member arrives). The runtime keeps 'kept' parameters gathered from the
forward to the backward and holds 'replicated' ones whole on every rank
(no gather; an all-reduce of the gradient). ``dcsched train
--replicate-below N`` marks the small parameters 'replicated' in every plan
it runs; of the schedulers, ``overlap-plan`` sets 'kept'.

>>> plan = Plan(("w", "ag", "out"), buckets=(Bucket("allgather", ("ag",), (0,)),))
>>> plan.residency_of(0), len(plan), plan.buckets[0].members
('sharded', 3, ('ag',))
>>> Plan(("x",), residency={3: "kept"}).residency_of(3)
'kept'
"""

from __future__ import annotations

import dataclasses
import types
from typing import Iterable, Mapping, Sequence

from dcsched import collectives

#: A bucket's kinds: fused all-gathers, fused gradient reduces (which collective kinds each fuses:
#: :func:`dcsched.collectives.bucket_ops`).
BUCKET_KINDS = collectives.BUCKET_KINDS
#: Where a parameter lives between its uses.
RESIDENCIES = ("sharded", "kept", "replicated")
#: A parameter not named in :attr:`Plan.residency`.
DEFAULT_RESIDENCY = "sharded"
#: The option by which a scheduler replicates parameters of its own accord (the largest, in gathered bytes; 0:
#: none): training sets it to 0, since it shards the module before any plan.
REPLICATE_OPTION = "replicate_max_bytes"
#: ``overlap-plan``'s option: where no ``fsdp`` plan fits the budget, ``overlap``'s orders with neighbouring
#: collectives merged replace the bucketed plan where the simulator finds them faster (its step 7). Training on
#: the CPU turns it off: gloo's collectives take CPU from the compute, which the simulator does not charge.
MERGED_OVERLAP_OPTION = "merged_overlap"
#: ``overlap-plan``'s option: the budget bounds the peak with gloo's staging copies counted, every collective
#: blocking (:mod:`dcsched.sim.staging`). Training on gloo turns it on: the flat tensors gloo's collectives
#: allocate for themselves are memory the budget promised.
STAGING_OPTION = "staging"
#: ``overlap-plan``'s option: the step times count every collective blocking, on the critical path (the plan of
#: a run that issues them so); off, the simulator's model times them beside the compute.
BLOCKING_OPTION = "blocking"
#: :class:`Plan`'s default residency: none named (read-only, so one object can serve every plan).
NO_RESIDENCY: Mapping[int, str] = types.MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Communication nodes meant to run as one collective.

    Parameters
    ----------
    kind : str
        ``'allgather'`` or ``'reduce'``.
    members : tuple of str
        The member nodes' names, in the order they are needed.
    ds_ids : tuple of int
        The members' parameter ids, in the same order.

    Raises
    ------
    ValueError
        For an unknown kind, no member, or ``ds_ids`` not matching ``members``.

    Examples
    --------
    >>> Bucket("reduce", ["r1", "r2"], [4, 5])
    Bucket(kind='reduce', members=('r1', 'r2'), ds_ids=(4, 5))
    """

    kind: str
    members: tuple[str, ...]
    ds_ids: tuple[int, ...]

    # Written out (dataclass keeps a class's own __init__) so that the parameters say what is taken, any
    # sequence, while the fields say what is kept, a tuple.
    def __init__(self, kind: str, members: Sequence[str], ds_ids: Sequence[int]) -> None:
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "members", tuple(members))
        object.__setattr__(self, "ds_ids", tuple(ds_ids))
        if self.kind not in BUCKET_KINDS:
            raise ValueError(f"unknown bucket kind {self.kind!r} (choose from {', '.join(BUCKET_KINDS)})")
        if not self.members or len(self.members) != len(self.ds_ids):
            raise ValueError(f"a bucket needs members and one ds_id per member "
                             f"({len(self.members)} members, {len(self.ds_ids)} ds_ids)")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A scheduler's result.

    Parameters
    ----------
    order : sequence of str
        Every node of the graph exactly once, by name, in a topological order
        ending with the output (kept as a tuple).
    buckets : iterable of Bucket, optional
        Fused collectives (default none).
    residency : mapping of int to str, optional
        ``ds_id`` -> ``'sharded'``, ``'kept'`` or ``'replicated'``; a
        parameter not named is ``'sharded'`` (default: every one).

    Raises
    ------
    ValueError
        For an unknown residency.

    Examples
    --------
    >>> Plan(["a", "b"]).order, Plan(["a", "b"]).buckets, dict(Plan(["a"]).residency)
    (('a', 'b'), (), {})
    """

    order: tuple[str, ...]
    buckets: tuple[Bucket, ...] = ()
    residency: Mapping[int, str] = dataclasses.field(default_factory=dict)

    # Written out (dataclass keeps a class's own __init__) so that the parameters say what is taken, any
    # sequence or iterable, while the fields say what is kept, tuples and a read-only mapping.
    def __init__(self, order: Sequence[str], buckets: Iterable[Bucket] = (),
                 residency: Mapping[int, str] = NO_RESIDENCY) -> None:
        object.__setattr__(self, "order", order if isinstance(order, tuple) else tuple(order))
        object.__setattr__(self, "buckets", tuple(buckets))
        bad = sorted({r for r in residency.values() if r not in RESIDENCIES})
        if bad:
            raise ValueError(f"unknown residency {', '.join(map(repr, bad))} (choose from {', '.join(RESIDENCIES)})")
        object.__setattr__(self, "residency", types.MappingProxyType(dict(residency)))

    def __len__(self) -> int:
        return len(self.order)

    def residency_of(self, ds_id: int) -> str:
        """Where parameter ``ds_id`` lives between uses (``'sharded'`` unless the plan says otherwise).

        Examples
        --------
        >>> Plan(()).residency_of(7)
        'sharded'
        """
        return self.residency.get(ds_id, DEFAULT_RESIDENCY)

    def replicating(self, ds_ids: Iterable[int]) -> Plan:
        """The same plan with ``ds_ids`` ``'replicated'`` (overriding what it said of them).

        Examples
        --------
        >>> dict(Plan(("a",), residency={1: "kept", 2: "kept"}).replicating([1, 3]).residency)
        {1: 'replicated', 2: 'kept', 3: 'replicated'}
        """
        return dataclasses.replace(self, residency={**self.residency, **{int(d): "replicated" for d in ds_ids}})

    def with_order(self, order: Iterable[str]) -> Plan:
        """The same plan with another order (buckets and residency kept).

        Examples
        --------
        >>> Plan(("b", "a"), residency={1: "kept"}).with_order(["a", "b"]).order
        ('a', 'b')
        """
        return dataclasses.replace(self, order=tuple(order))
