"""The activation memory a captured step saves for its backward, with and without its checkpointing.

A bundle captured from a step records in its provenance the bytes of the
tensors its forward saves for the backward (``saved_for_backward_bytes``) and,
where the step checkpoints (recomputed regions, or an activation memory budget
below 1), what the same step would save with neither
(``saved_for_backward_bytes_without_checkpointing``). Both are per rank:
ZeRO-3 shards parameters, not activations. :func:`from_provenance` reads and
checks them (the loader calls it, so a bundle with figures out of bounds does
not load); :meth:`SavedActivations.describe` is the report's line.

No torch here: the figures are plain integers (the graph side is
:mod:`dcsched.profile.saved_activations`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dcsched.units import format_bytes

#: Provenance key: bytes the captured forward saves for the backward.
SAVED_KEY = "saved_for_backward_bytes"
#: Provenance key: bytes the same step saves without its checkpointing (no recomputed region, no budget).
WITHOUT_KEY = "saved_for_backward_bytes_without_checkpointing"
#: The largest figure a bundle may hold (1 EiB): larger is not a step's activation memory.
MAX_BYTES = 2**60


@dataclasses.dataclass(frozen=True)
class SavedActivations:
    """Bytes saved for the backward by a step; ``without_checkpointing`` None where it does not checkpoint.

    Examples
    --------
    >>> SavedActivations(2 * 2**20, 8 * 2**20).describe()
    'activation memory saved for backward: 2.00 MiB (checkpointed) vs 8.00 MiB without (-75.0%)'
    >>> SavedActivations(3 * 2**20).describe()
    'activation memory saved for backward: 3.00 MiB (no checkpointing: no saving)'
    >>> SavedActivations(2 * 2**20, 8 * 2**20).reduction
    0.75
    """

    saved_bytes: int
    without_checkpointing: int | None = None

    @property
    def reduction(self) -> float | None:
        """The fraction of the unchecked step's saved bytes that checkpointing spares (None: no checkpointing)."""
        if self.without_checkpointing is None:
            return None
        if self.without_checkpointing == 0:
            return 0.0
        return (self.without_checkpointing - self.saved_bytes) / self.without_checkpointing

    def provenance(self) -> dict[str, int]:
        """The provenance entries that record these figures.

        >>> SavedActivations(10, 40).provenance()
        {'saved_for_backward_bytes': 10, 'saved_for_backward_bytes_without_checkpointing': 40}
        """
        out = {SAVED_KEY: self.saved_bytes}
        if self.without_checkpointing is not None:
            out[WITHOUT_KEY] = self.without_checkpointing
        return out

    def to_json(self) -> dict[str, Any]:
        """The figures as the JSON reports carry them (``reduction`` a fraction, None without checkpointing)."""
        return {"saved_bytes": self.saved_bytes, "without_checkpointing_bytes": self.without_checkpointing,
                "reduction": self.reduction}

    def describe(self) -> str:
        """One line: the saved bytes, and against the unchecked step's where the step checkpoints."""
        head = f"activation memory saved for backward: {format_bytes(self.saved_bytes)}"
        if self.without_checkpointing is None:
            return f"{head} (no checkpointing: no saving)"
        reduction = self.reduction or 0.0
        return (f"{head} (checkpointed) vs {format_bytes(self.without_checkpointing)} without "
                f"({-100.0 * reduction:+.1f}%)")


def _figure(provenance: Mapping[str, Any], key: str) -> int | None:
    value = provenance.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BYTES:
        raise ValueError(f"the bundle's provenance {key} {str(value)[:40]!r} is not a byte count "
                         f"from 0 to {MAX_BYTES}")
    return value


def from_provenance(provenance: Mapping[str, Any]) -> SavedActivations | None:
    """The figures a bundle's provenance records, or None where it records none.

    Raises
    ------
    ValueError
        A figure is not an integer from 0 to :data:`MAX_BYTES`, or the unchecked figure comes without the
        checkpointed one.

    Examples
    --------
    >>> from_provenance({"saved_for_backward_bytes": 5})
    SavedActivations(saved_bytes=5, without_checkpointing=None)
    >>> from_provenance({}) is None
    True
    >>> from_provenance({"saved_for_backward_bytes": -1})
    Traceback (most recent call last):
    ...
    ValueError: the bundle's provenance saved_for_backward_bytes '-1' is not a byte count from 0 to 1152921504606846976
    """
    saved, without = _figure(provenance, SAVED_KEY), _figure(provenance, WITHOUT_KEY)
    if saved is None:
        if without is not None:
            raise ValueError(f"the bundle's provenance has {WITHOUT_KEY} but no {SAVED_KEY}")
        return None
    return SavedActivations(saved, without)
