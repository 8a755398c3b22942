"""What a bucket of collectives costs, and which latency a bundle's figures were made with.

Every all-gather and every gradient reduce-scatter costs a fixed latency plus
its bytes over the bandwidth (:func:`dcsched.costmodels.formulas.comm_time_ms`).
A bucket of k all-gathers (or k reduces) run as one collective moves the same
bytes and pays the latency once, so it takes the sum of its members' times less
``(k - 1)`` latencies (:func:`bucket_time_ms`).

The latency is the one the bundle's figures were made with: the profiler
records it in ``provenance['comm_latency_ms']`` (:func:`latency_from_provenance`).
A bundle profiled before that holds ``provenance['latency_us']`` (the modelled
collectives' latency) or nothing (collectives measured under a process group,
or no profile); without either, :data:`DEFAULT_LATENCY_MS` (20 us, the one
latency every profile used before the interconnect table) is used.

>>> bucket_time_ms([1.02, 2.02, 0.52], latency_ms=0.02)  # 3.56 ms alone, one latency instead of three
3.52
>>> latency_from_provenance({"comm_latency_ms": 0.05}), latency_from_provenance({})
(0.05, 0.02)
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

#: The per-collective latency (ms) a bundle that records none is taken to have: 20 us, every profile's latency
#: before the figures came from the interconnect table (:mod:`dcsched.costmodels.interconnects`). Fixed, so that
#: the bundles written then (and measured ones) keep simulating as they did.
DEFAULT_LATENCY_MS = 0.020


def bucket_time_ms(durations: Iterable[float], *, latency_ms: float = DEFAULT_LATENCY_MS) -> float:
    """The time (ms) of a bucket's members run as one collective.

    Each member's ``device_time`` is its latency plus its bytes over the
    bandwidth; the fused collective pays the latency once:
    ``sum(durations) - (k - 1) * latency_ms`` for ``k`` members. It is never
    shorter than its longest member (a member whose figure is below the
    latency, e.g. a measured one, gives no more than it holds).

    Parameters
    ----------
    durations : iterable of float
        The members' ``device_time`` (ms), each an all-gather or each a reduce.
    latency_ms : float, optional
        The per-collective latency the figures include (ms, not negative);
        default :data:`DEFAULT_LATENCY_MS`.

    Returns
    -------
    float
        The fused collective's time in ms; a bucket of one member takes its own time, exactly.

    Raises
    ------
    ValueError
        For no member or a negative latency.

    Examples
    --------
    >>> bucket_time_ms([2.0, 2.0], latency_ms=0.5)
    3.5
    >>> bucket_time_ms([0.75], latency_ms=0.5)
    0.75
    >>> bucket_time_ms([3.0, 0.01, 0.01], latency_ms=0.02)  # never below its longest member
    3.0
    """
    times = list(durations)
    if not times:
        raise ValueError("a bucket needs at least one member")
    if latency_ms < 0:
        raise ValueError(f"latency must not be negative (got {latency_ms} ms)")
    if len(times) == 1:
        return times[0]
    return max(sum(times) - (len(times) - 1) * latency_ms, max(times))


def transfer_time_ms(duration_ms: float, *, latency_ms: float = DEFAULT_LATENCY_MS) -> float:
    """The part of a collective's ``device_time`` that grows with its bytes: the time less its latency.

    Never negative (a measured figure may be below the latency).

    >>> transfer_time_ms(1.02, latency_ms=0.02), transfer_time_ms(0.01, latency_ms=0.02)
    (1.0, 0.0)
    """
    return max(0.0, duration_ms - latency_ms)


def latency_time_ms(collectives: int, *, latency_ms: float = DEFAULT_LATENCY_MS) -> float:
    """What ``collectives`` collectives pay in latency alone: each pays it once, however many bytes it moves.

    >>> latency_time_ms(3, latency_ms=0.02)
    0.06
    """
    return collectives * latency_ms


def all_reduce_time_ms(reduce_ms: float, latency_ms: float = DEFAULT_LATENCY_MS) -> float:
    """The time (ms) of an all-reduce of the gradient a reduce-scatter taking ``reduce_ms`` reduces.

    A ring all-reduce is a reduce-scatter followed by an all-gather of the
    same bytes, so it moves twice the reduce-scatter's bytes over the
    bandwidth, in one collective that pays the latency once:
    ``2 * (reduce_ms - latency_ms) + latency_ms``. Never below ``reduce_ms``
    (a figure below the latency, e.g. a measured one, is taken as it is).

    Examples
    --------
    >>> all_reduce_time_ms(1.02, latency_ms=0.02)
    2.02
    >>> all_reduce_time_ms(0.01, latency_ms=0.02)
    0.01
    """
    return max(2.0 * reduce_ms - latency_ms, reduce_ms)


def latency_from_provenance(provenance: Mapping[str, Any] | None) -> float:
    """The per-collective latency (ms) a bundle's communication figures include.

    ``provenance['comm_latency_ms']`` (what :func:`dcsched.profile.measure.profile_bundle`
    records); else ``provenance['latency_us'] / 1000`` (bundles profiled before it);
    else :data:`DEFAULT_LATENCY_MS`.

    Examples
    --------
    >>> latency_from_provenance({"latency_us": 5.0}), latency_from_provenance({"latency_us": None})
    (0.005, 0.02)
    """
    provenance = provenance or {}
    ms: Any = provenance.get("comm_latency_ms")
    us: Any = provenance.get("latency_us")
    if _number(ms):
        return float(ms)
    if _number(us):
        return float(us) / 1e3
    return DEFAULT_LATENCY_MS


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
