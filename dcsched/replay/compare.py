"""Comparing two runs' results: bit for bit, or the largest difference and where."""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import torch
import torch.fx

from dcsched.errors import ResultMismatch


#: (rtol, atol) by dtype where bit-for-bit equality is not asked for.
TOLERANCES = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
}


@dataclasses.dataclass(frozen=True)
class ResultComparison:
    """Two runs' results agree: how many outputs, how strictly, and the largest difference."""

    outputs: int
    exact: bool
    max_abs_error: float
    worst_output: str | None
    tolerance: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point or a.dtype.is_complex:
        a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    return torch.equal(a, b)


def _difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype == torch.bool:
        return (a != b).to(torch.float64)
    diff = (a.to(torch.float64) - b.to(torch.float64)).abs()
    both_nan = torch.isnan(a.to(torch.float64)) & torch.isnan(b.to(torch.float64))
    return diff.masked_fill(both_nan, 0.0).nan_to_num(nan=math.inf)


def compare(reference: Mapping[str, torch.Tensor], candidate: Mapping[str, torch.Tensor], *,
            exact: bool = True, rtol: float | None = None, atol: float | None = None,
            names: tuple[str, str] = ("baseline", "scheduled")) -> ResultComparison:
    """Check ``candidate`` computed what ``reference`` did; raise :class:`ResultMismatch` naming
    the first output that differs.

    ``exact``: bit for bit. Otherwise ``rtol``/``atol`` (default: :data:`TOLERANCES` by dtype).
    """
    ref_name, cand_name = names
    if list(reference) != list(candidate):
        only_ref = [k for k in reference if k not in candidate]
        only_cand = [k for k in candidate if k not in reference]
        raise ResultMismatch(f"the runs return different outputs (only in {ref_name}: {only_ref or 'none'}; "
                             f"only in {cand_name}: {only_cand or 'none'})")
    worst, worst_name = 0.0, None
    for name, a in reference.items():
        b = candidate[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ResultMismatch(f"{name}: {ref_name} is {a.dtype} {tuple(a.shape)}, "
                                 f"{cand_name} is {b.dtype} {tuple(b.shape)}")
        diff = _difference(a, b)
        largest = float(diff.max()) if diff.numel() else 0.0
        if exact:
            same = _bits_equal(a, b)
        else:
            r, t = TOLERANCES.get(a.dtype, (0.0, 0.0))
            r, t = (rtol if rtol is not None else r), (atol if atol is not None else t)
            same = bool(torch.isclose(a, b, rtol=r, atol=t, equal_nan=True).all()) if a.numel() else True
        if not same:
            count = int((diff != 0).sum())
            where = ""
            if diff.numel():
                flat = int(diff.reshape(-1).argmax())
                index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
                where = (f" at index {index} ({ref_name} {a.reshape(-1)[flat].item():.9g}, "
                         f"{cand_name} {b.reshape(-1)[flat].item():.9g})")
            how = "bit for bit" if exact else "within tolerance"
            what = (f"{count} of {a.numel()} elements differ ({how})" if count else
                    "elements differ in their bits only (signed zeros or NaN payloads)")
            raise ResultMismatch(f"first differing output: {name}: {what}; largest error {largest:.3g}{where}")
        if largest > worst or worst_name is None:
            worst, worst_name = largest, name
    tolerance = "bit for bit" if exact else (
        f"rtol={rtol}, atol={atol}" if rtol is not None or atol is not None else
        "rtol/atol by dtype: " + ", ".join(f"{str(d).removeprefix('torch.')} {r:g}/{t:g}"
                                           for d, (r, t) in TOLERANCES.items()))
    return ResultComparison(len(reference), exact, worst, worst_name, tolerance)
