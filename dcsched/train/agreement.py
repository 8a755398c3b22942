"""Each step's agreement: the ranks settle how they run a step before any of them issues its collectives.

TorchDynamo decides alone on each rank whether a call needs a new compile
(``dynamic=False``: any new input shape does). Where the ranks' batches differ
in shape (an uneven last batch: 4, 4 and 3 rows; padding each batch to its
own longest sequence), one rank compiles while the others run a cached
program, and a compile's exchanges (the consensus checks, the measured
profile's collectives) would meet the others' training collectives. So every
call of a sharded module's graph, compiled or cached, first exchanges a few
numbers over a gloo group of its own (:func:`announce`): whether the rank is
compiling, a digest of its input shapes, a digest of its planned program,
and a digest of its step as captured (the order of its all-gathers and
reduce-scatters, by parameter, which does not depend on shapes). Every rank
then takes the same decision from the same numbers:

* ``'planned'``: every rank holds the same shapes, and either all are
  compiling (they profile, agree and schedule together, as at the first
  step) or none is and they run one plan. The usual case.
* ``'captured'``: otherwise, if every rank's step as captured issues the same
  collectives: each rank runs its step in the captured order with one
  collective per parameter (the ``none`` schedule, which needs no profile, so
  a rank compiling alone issues nothing more). Gradients are averaged over
  the ranks as always, so an uneven last batch trains as a plain multi-rank
  run does; it is slower than the plan, for the steps whose shapes differ.
* otherwise (the ranks' steps differ in structure) every rank stops with one
  line naming the ranks that differ and their input shapes.

>>> decide([(1, 7, 0, 5), (1, 7, 0, 5)]), decide([(0, 7, 9, 5), (1, 8, 0, 5)])
('planned', 'captured')
>>> decide([(0, 7, 9, 5), (0, 8, 3, 6)]) is None
True
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from typing import Sequence

import torch

from dcsched.runtime.consensus import RankMismatch, differing_ranks, ranks_text
from dcsched.runtime.distributed import note_issued

#: The agreement's own gloo group per sharding's process group (made at the first compile, on every rank).
_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCAL = threading.local()  # .alone: the latest compile on this thread ran without the other ranks


def digest(data: bytes | str) -> int:
    """A 63-bit digest (an int64 a collective carries), never 0: 0 means none."""
    raw = data.encode() if isinstance(data, str) else data
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "little") & (2**63 - 1) or 1


def shapes_of(sharding, inputs: Sequence) -> str:
    """The step's own tensors (no parameter, no stand-in) as ``(4, 8) int64, ...``, for digests and messages."""
    return ", ".join(f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}" for value in inputs
                     if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
                     and sharding.spec_of_stand_in(value) is None) or "no tensors"


def captured_collectives(bundle) -> int:
    """A digest of the collectives a bundle's graphs issue in their own order, one per parameter: the parameter
    table (what sizes each ds_id's collectives have) and the all-gathers and reduce-scatters by ds_id; the inputs'
    shapes are not in it."""
    from dcsched.graph.roles import Role, comm_ids, role_of
    parts = [";".join(f"{p.name}:{tuple(p.shape)}:{p.dtype}" for p in bundle.params)]
    for name, graph in bundle.graphs.items():
        ops = [f"{role_of(node).value}:{comm_ids(node)[1]}" for node in graph.nodes
               if role_of(node) in (Role.ALLGATHER, Role.REDUCE)]
        parts.append(f"{name}={','.join(ops)}")
    return digest(";".join(parts))


def decide(announced: Sequence[Sequence[int]]) -> str | None:
    """``'planned'``, ``'captured'`` or None (the steps differ), from each rank's
    ``(compiling, shapes, plan, captured)`` (see the module docstring)."""
    compiling = {entry[0] for entry in announced}
    shapes = {entry[1] for entry in announced}
    plans = {entry[2] for entry in announced}
    if len(shapes) == 1 and (compiling == {1} or (compiling == {0} and len(plans) == 1 and 0 not in plans)):
        return "planned"
    if len({entry[3] for entry in announced}) == 1:
        return "captured"
    return None


def _group(sharding):
    """The agreement's gloo group for ``sharding``'s ranks (``new_group`` is collective: the first compile, where
    every rank compiles, makes it)."""
    import torch.distributed as dist
    key = sharding.group if sharding.group is not None else dist.group.WORLD
    group = _GROUPS.get(key)
    if group is None:  # gloo whatever the training backend: the numbers live on the CPU, no device sync
        group = _GROUPS[key] = dist.new_group(dist.get_process_group_ranks(key), backend="gloo",
                                              timeout=_timeout_of(key))
    return group


def _timeout_of(group):
    """The training group's timeout (``dcsched train --timeout``), which the agreement's group takes too; None
    (torch's default) where it cannot be read."""
    try:
        device = torch.device("cuda") if group._get_backend_name() == "nccl" else torch.device("cpu")
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def announce(sharding, inputs: Sequence, *, compiling: bool, plan: int, captured: int, what: str) -> str:
    """Exchange this rank's step with the others' and return the decision every rank takes (module docstring).

    ``what`` names the module in the error. Raises :class:`~dcsched.runtime.consensus.RankMismatch` on every
    rank where the ranks' steps differ in structure. Without several ranks: ``'planned'``.
    """
    if sharding.world_size < 2:
        return "planned"
    import torch.distributed as dist
    group = _group(sharding)
    shapes = shapes_of(sharding, inputs)
    mine = torch.tensor([int(compiling), digest(shapes), plan, captured], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(sharding.world_size)]
    # Counted as a collective the step issues: a peer stuck between steps leaves this rank waiting here, one
    # collective ahead of it, which is how the failure watch names it.
    note_issued()
    dist.all_gather(everyone, mine, group=group)
    announced = [[int(v) for v in t.tolist()] for t in everyone]
    decision = decide(announced)
    if decision is not None:
        return decision
    described: list = [None] * sharding.world_size
    dist.all_gather_object(described, shapes, group=group)
    odd = differing_ranks([entry[3].to_bytes(8, "little") for entry in announced])
    others = [rank for rank in range(sharding.world_size) if rank not in odd]
    raise RankMismatch(f"{ranks_text(odd)} of {what} ran a step of another structure than {ranks_text(others)} "
                       f"(inputs {'; '.join(f'rank {r}: {described[r]}' for r in odd)}; rank {others[0]}: "
                       f"{described[others[0]]}): the ranks' batches may differ in size, not in what the model "
                       "does with them")


def mark_compiled_alone(alone: bool) -> None:
    """Record whether this thread's latest compile ran without the other ranks (so they do not meet after it)."""
    _LOCAL.alone = alone


def compiled_alone() -> bool:
    """Whether this thread's latest compile ran without the other ranks; reading it clears it."""
    alone = getattr(_LOCAL, "alone", False)
    _LOCAL.alone = False
    return alone
