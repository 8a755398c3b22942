"""A memory budget: read once where it enters dcsched, a number of bytes from then on.

A budget is given as text on the command line (``--memory-budget 40GiB``), as
a number or text in Python (``memory_budget=40 * 2**30``, ``'40GiB'``,
``math.inf``, ``'unlimited'``), or not at all. Each entry point (``dcsched
schedule``, ``dcsched train`` and :func:`dcsched.backend`, :func:`dcsched.schedule`,
the sweep) turns what it was given into one :class:`Budget` with
:func:`budget_for`, and the schedulers receive its bytes (a float,
``math.inf`` for no limit) and its scope, never text.

The one default rule (:func:`default_budget`): with no budget given, the
target device's memory recorded in a bundle's provenance less
:data:`DEFAULT_MARGIN` (DeepSpeed plans for 90% of the device); where no device
is recorded (a bare graph, a bundle without one), no limit. Training makes one
exception (:meth:`dcsched.train.options.TrainOptions.budget`): a step planner
given no budget where no device is recorded plans within the peak of FSDP2's
policy (``'fsdp'``, :mod:`dcsched.schedulers.fsdp.peak`).

>>> Budget.parse("6GiB")
Budget(bytes=6442450944, scope='all')
>>> Budget.parse("unlimited").is_unlimited, Budget.parse(None) == Budget.unlimited()
(True, True)
>>> Budget.parse(2**30, scope="gathered").scope
'gathered'
>>> budget_for(None, None) == Budget.unlimited()
True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dcsched.errors import OptionError
from dcsched.units import MAX_SIZE_BYTES, parse_size  # noqa: F401

#: The budget's value for "no limit".
UNLIMITED = math.inf
#: The training budget that names the peak of FSDP2's policy on the step (:mod:`dcsched.schedulers.fsdp.peak`).
FSDP_BUDGET = "fsdp"
#: What ``--memory-budget`` and ``memory_budget=`` accept for "no limit".
UNLIMITED_WORDS = ("unlimited", "infinite", "inf", "none")
#: What a budget can cap: all tensors, or the gathered parameters alone.
SCOPES = ("gathered", "all")
#: What a budget caps unless told otherwise: all tensors, the figure that decides an out-of-memory
#: error and the one a device's memory (the default budget) and DeepCompile's own pipeline speak of.
DEFAULT_SCOPE = "all"
#: Share of the device's memory the default budget leaves free: the CUDA context, the caching
#: allocator's fragmentation and kernel workspaces, which the simulator does not model.
DEFAULT_MARGIN = 0.10
#: What a memory budget option means, for every command and options class that takes one (written once).
MEMORY_BUDGET_HELP = ("Memory budget for the schedulers that take one, in bytes with an optional SI/IEC suffix "
                      "(40GiB, 1.5GB) or 'unlimited' (default: the target device's memory less 10%, unlimited "
                      "where none is known).")
BUDGET_SCOPE_HELP = ("What the budget caps, for the schedulers that take it: all (all tensors, the default) or "
                     "gathered (gathered parameters).")


def check_scope(scope: str) -> str:
    """``scope`` if it is one of :data:`SCOPES`.

    Parameters
    ----------
    scope : str
        ``'all'`` or ``'gathered'``.

    Returns
    -------
    str
        ``scope`` itself.

    Raises
    ------
    OptionError
        For any other value (the message names ``budget_scope``).

    Examples
    --------
    >>> check_scope("gathered")
    'gathered'
    """
    if scope not in SCOPES:
        raise OptionError("budget_scope", f"names an unknown budget scope {scope!r} (choose from {', '.join(SCOPES)})")
    return scope


@dataclasses.dataclass(frozen=True)
class Budget:
    """A memory budget: ``bytes`` (an int, or ``math.inf`` for no limit) over ``scope``.

    ``scope`` is ``'all'`` (all tensors, the default) or ``'gathered'``
    (gathered parameters only). Build one with :meth:`parse`,
    :meth:`unlimited` or :func:`budget_for`; the constructor checks both fields.

    Examples
    --------
    >>> Budget(1000).bytes, Budget(1000).is_unlimited
    (1000, False)
    >>> Budget(-1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    dcsched.errors.OptionError: memory_budget is not a size: -1 (a budget is a number of bytes, 0 or more, ...)
    """

    bytes: float
    scope: str = DEFAULT_SCOPE

    def __post_init__(self):
        value = self.bytes
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
            raise OptionError("memory_budget", f"is not a size: {value!r} (a budget is a number of bytes, 0 or "
                                               "more, or 'unlimited')")
        check_scope(self.scope)

    @property
    def is_unlimited(self) -> bool:
        """Whether the budget sets no limit."""
        return self.bytes == UNLIMITED

    @classmethod
    def unlimited(cls, scope: str = DEFAULT_SCOPE) -> Budget:
        """No limit.

        Parameters
        ----------
        scope : str, optional
            ``'all'`` (default) or ``'gathered'``.

        Returns
        -------
        Budget
            ``Budget(math.inf, scope)``.

        Examples
        --------
        >>> Budget.unlimited().bytes
        inf
        """
        return cls(UNLIMITED, scope)

    @classmethod
    def parse(cls, value: Any, scope: str | None = None) -> Budget:
        """The budget ``value`` says: the one reader of ``--memory-budget`` and ``memory_budget=``.

        Parameters
        ----------
        value : str, int, float, Budget or None
            A size (:func:`dcsched.units.parse_size`: ``'6GiB'``, ``'1.5GB'``,
            ``1.5e9``; any finite size, however large: one over every tensor
            simply never binds, DeepSpeed passes 1e30), one of
            :data:`UNLIMITED_WORDS`, ``math.inf``, or None (no limit). A
            :class:`Budget` is returned as it is (with ``scope``, if given).
        scope : str, optional
            ``'all'`` or ``'gathered'``; default :data:`DEFAULT_SCOPE`.

        Returns
        -------
        Budget

        Raises
        ------
        OptionError
            Naming ``memory_budget`` for a value that is not a budget (NaN, a
            negative number, an overflow such as ``'1e400GB'``, a bool), naming
            ``budget_scope`` for an unknown scope.

        Examples
        --------
        >>> Budget.parse("800MB").bytes, Budget.parse(1.5e9).bytes, Budget.parse("inf").bytes
        (800000000, 1500000000, inf)
        >>> Budget.parse("-5")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        dcsched.errors.OptionError: memory_budget is not a size: '-5' (use e.g. 512MiB, ...); or 'unlimited'
        """
        if isinstance(value, Budget):
            return value if scope is None or scope == value.scope else dataclasses.replace(value, scope=scope)
        scope = DEFAULT_SCOPE if scope is None else scope
        if value is None:
            return cls(UNLIMITED, scope)
        if isinstance(value, str) and value.strip().lower() in UNLIMITED_WORDS:
            return cls(UNLIMITED, scope)
        if isinstance(value, float) and value == math.inf:
            return cls(UNLIMITED, scope)
        if names_fsdp_budget(value):
            raise OptionError("memory_budget", f"'{FSDP_BUDGET}' (the peak of FSDP2's policy on the step) is a "
                                               "training budget (dcsched train, dcsched.backend); give a size or "
                                               "'unlimited' here")
        try:
            nbytes = parse_size(value, limit=math.inf)
        except (ValueError, TypeError) as exc:
            detail = str(exc) if isinstance(exc, ValueError) else f"not a size: {value!r}"
            raise OptionError("memory_budget", f"is {detail}; or 'unlimited'") from None
        return cls(nbytes, scope)

    def to_dict(self) -> dict:
        """JSON form: ``{'bytes': int or None (unlimited), 'scope': str}``.

        Examples
        --------
        >>> Budget.unlimited().to_dict()
        {'bytes': None, 'scope': 'all'}
        """
        return {"bytes": None if self.is_unlimited else int(self.bytes), "scope": self.scope}


def names_fsdp_budget(value: object) -> bool:
    """Whether a memory budget as given (``--memory-budget``, ``memory_budget=``) names :data:`FSDP_BUDGET`.

    >>> names_fsdp_budget(" FSDP "), names_fsdp_budget("40GiB"), names_fsdp_budget(None)
    (True, False, False)
    """
    return isinstance(value, str) and value.strip().lower() == FSDP_BUDGET


def device_memory(source: Any) -> int | None:
    """The target device's memory (bytes) recorded in ``source``'s provenance, or None.

    Parameters
    ----------
    source : Bundle, dict, GraphForm, torch.fx.Graph or None
        A bundle (its ``provenance``), a provenance dict, or anything else (no device known).

    Returns
    -------
    int or None

    Examples
    --------
    >>> device_memory({"target_memory_bytes": 80 * 10**9}), device_memory(None)
    (80000000000, None)
    """
    provenance = source if isinstance(source, dict) else getattr(source, "provenance", None)
    total = (provenance or {}).get("target_memory_bytes")
    return total or None


def default_budget(source: Any = None, *, scope: str | None = None, margin: float | int = DEFAULT_MARGIN) -> Budget:
    """The budget used when none is given: the one default rule of ``schedule``, ``train`` and the sweep.

    Parameters
    ----------
    source : Bundle, dict or None
        Where the target device's memory may be recorded (:func:`device_memory`).
        A bare graph or graph form records none.
    scope : str, optional
        The budget's scope (default :data:`DEFAULT_SCOPE`).
    margin : float or int, optional
        Below 1: a share of the device's memory left free (default 10%); 1 or
        more: a number of bytes.

    Returns
    -------
    Budget
        The device's memory less ``margin``; :meth:`Budget.unlimited` where no
        device is recorded.

    Raises
    ------
    OptionError
        Naming ``margin`` when it is negative or leaves no memory.

    Examples
    --------
    >>> prov = {"target_memory_bytes": 80 * 2**30}
    >>> default_budget(prov).bytes == int(72 * 2**30), default_budget(prov, margin=2 * 2**30).bytes == 78 * 2**30
    (True, True)
    >>> default_budget(None).is_unlimited
    True
    """
    scope = DEFAULT_SCOPE if scope is None else check_scope(scope)
    total = device_memory(source)
    if total is None:
        return Budget.unlimited(scope)
    if margin < 0:
        raise OptionError("margin", f"must not be negative ({margin})")
    reserve = total * margin if margin < 1 else margin
    nbytes = int(total - reserve)
    if nbytes <= 0:
        raise OptionError("margin", f"of {margin} leaves no memory of the device's {total} bytes")
    return Budget(nbytes, scope)


def budget_for(value: Any, source: Any = None, *, scope: str | None = None) -> Budget:
    """The budget to schedule with: ``value`` if one was given, else :func:`default_budget` of ``source``.

    Parameters
    ----------
    value : str, int, float, Budget or None
        What the user gave (:meth:`Budget.parse`); None: nothing given.
    source : Bundle, dict or None
        Where the default rule looks for the target device's memory.
    scope : str, optional
        ``'all'`` or ``'gathered'`` (default :data:`DEFAULT_SCOPE`).

    Returns
    -------
    Budget

    Raises
    ------
    OptionError
        For a value that is not a budget or an unknown scope.

    Examples
    --------
    >>> budget_for("1GiB", {"target_memory_bytes": 80 * 2**30}).bytes
    1073741824
    >>> budget_for(None, {"target_memory_bytes": 10**9}).bytes
    900000000
    """
    if value is None:
        return default_budget(source, scope=scope)
    return Budget.parse(value, scope=scope)
