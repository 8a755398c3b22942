"""``calibrated``: the analytic time scaled by measured factors, one per op kind, read from a JSON file.

The analytic time uses published fractions of peak; a GPU's real kernels
reach their own, and that fraction depends mostly on the kind of op (a large matmul comes close, a
small elementwise op pays its launch). A calibration file holds, per op kind
(``aten.mm``, ``aten.add``, ...), the median of measured / analytic time over
the nodes of that kind in profiles measured on a GPU
(``benchmarks/gpu_check.py`` writes one): the calibrated time of a node is its
analytic time times its kind's factor, or the file's ``default`` factor for
kinds it does not list.

>>> cal = Calibration(gpu="h100", device="cuda:0 (NVIDIA H100)", factors={"aten.mm": 1.5}, default=3.0)
>>> cal.factor("aten.mm"), cal.factor("aten.add")
(1.5, 3.0)
>>> Calibration.from_dict(cal.to_dict()) == cal
True
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.fx

from dcsched.bundle.core import Bundle
from dcsched.outputs import write_atomic
from dcsched.errors import DcschedError, OptionError
from dcsched.graph.roles import Role, role_of
from dcsched.costmodels.analytic import AnalyticCostModel, analytic_time, target_gpu
from dcsched.costmodels.formulas import GPUS
from dcsched.costmodels.registry import register
from dcsched.safeparse import loads, parse_version

if TYPE_CHECKING:
    from dcsched.costmodels.options import ProfileOptions

FORMAT = "dcsched-calibration"
VERSION = 1


def op_kind(node: torch.fx.Node) -> str:
    """The op a node calls without its overload: ``aten.mm`` for ``aten.mm.default``."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None:
        return str(packet)
    return f"{getattr(node.target, '__module__', '') or ''}.{getattr(node.target, '__name__', node.target)}"


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured / analytic time factors by op kind, for the GPU ``gpu`` names (a key of ``GPUS``)."""

    gpu: str
    device: str
    factors: dict[str, float]
    default: float
    #: Nodes each factor is the median over.
    samples: dict[str, int] = dataclasses.field(default_factory=dict)

    def factor(self, kind: str) -> float:
        return self.factors.get(kind, self.default)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "gpu": self.gpu, "device": self.device,
                "default": self.default, "factors": dict(sorted(self.factors.items())),
                "samples": dict(sorted(self.samples.items()))}

    @classmethod
    def from_dict(cls, data: Any, source: str = "calibration") -> Calibration:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise DcschedError(f"{source}: not a dcsched calibration file (no \"format\": \"{FORMAT}\")")
        try:
            version = parse_version(data.get("version"), what="calibration version")
        except ValueError as exc:
            raise DcschedError(f"{source}: {exc}") from None
        if version != VERSION:
            raise DcschedError(f"{source}: calibration version {version}, this dcsched reads {VERSION}")
        gpu = str(data.get("gpu", "")).lower()
        if gpu not in GPUS:
            raise DcschedError(f"{source}: unknown GPU {data.get('gpu')!r} (choose from {', '.join(GPUS)})")
        factors = data.get("factors", {})
        values = [data.get("default"), *factors.values()] if isinstance(factors, dict) else [None]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values):
            raise DcschedError(f"{source}: factors must be positive numbers")
        samples = data.get("samples")
        samples = samples if isinstance(samples, dict) else {}
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in samples.values()):
            raise DcschedError(f"{source}: sample counts must be whole numbers")
        return cls(gpu, str(data.get("device", "")), {str(k): float(v) for k, v in factors.items()},
                   float(data["default"]), {str(k): v for k, v in samples.items()})

    def save(self, path: str | os.PathLike) -> Path:
        """Write the file atomically."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        write_atomic(path, lambda handle: handle.write(text.encode()))
        return Path(path)


def load_calibration(path: str | os.PathLike) -> Calibration:
    """Read a calibration file; one-line :class:`DcschedError` for a missing or malformed one."""
    try:
        data = loads(Path(path).read_bytes(), what="calibration")
    except OSError as exc:
        raise DcschedError(f"{path}: cannot read calibration ({exc.strerror})") from None
    except ValueError as exc:
        raise DcschedError(f"{path}: {exc}") from None
    return Calibration.from_dict(data, str(path))


def _ratios(analytic: Bundle, measured: Bundle, gpu: str) -> Iterable[tuple[str, float]]:
    """(op kind, measured / analytic) for each compute node both figures are positive for."""
    for name, graph in measured.graphs.items():
        reference = {node.name: node for node in analytic.graphs[name].nodes}
        for node in graph.nodes:
            if role_of(node) is not Role.COMPUTE or node.op != "call_function":
                continue
            estimate = reference[node.name].meta.get("device_time")
            if estimate is None:
                estimate = analytic_time(node, GPUS[gpu])
            ms = float(node.meta.get("device_time") or 0.0)
            if estimate > 0 and ms > 0:
                yield op_kind(node), ms / estimate


def fit_calibration(pairs: Iterable[tuple[Bundle, Bundle]], gpu: str, device: str) -> Calibration:
    """Factors from (analytic, measured) profiles of the same bundles: the median ratio per op kind.

    ``default`` is the median over every node, for kinds the profiles do not hold.
    """
    by_kind: dict[str, list[float]] = {}
    for analytic, measured in pairs:
        for kind, ratio in _ratios(analytic, measured, gpu.lower()):
            by_kind.setdefault(kind, []).append(ratio)
    every = [r for ratios in by_kind.values() for r in ratios]
    if not every:
        raise DcschedError("no compute node has both an analytic and a measured time: nothing to calibrate")
    return Calibration(gpu.lower(), device, {k: statistics.median(v) for k, v in by_kind.items()},
                       statistics.median(every), {k: len(v) for k, v in by_kind.items()})


@register
class CalibratedCostModel(AnalyticCostModel):
    name = "calibrated"
    description = "analytic time times measured factors by op kind (a calibration file)"
    takes_calibration = True

    def __init__(self, calibration: Calibration, source: str) -> None:
        super().__init__(GPUS[calibration.gpu], calibration.gpu)
        self.calibration, self.source = calibration, source

    @classmethod
    def from_options(cls, options: ProfileOptions) -> CalibratedCostModel:
        if options.calibration is None:
            raise OptionError("calibration", "is missing: the calibrated cost model needs a calibration file")
        calibration = load_calibration(options.calibration)
        if options.gpu is not None and target_gpu(options, cls.name) is not GPUS[calibration.gpu]:
            raise DcschedError(f"{options.calibration}: calibrated for {calibration.gpu}, not for {options.gpu}")
        return cls(calibration, str(options.calibration))

    def compute_time(self, node: torch.fx.Node) -> tuple[float, str]:
        ms = analytic_time(node, self.gpu)
        return (ms * self.calibration.factor(op_kind(node)) if ms else 0.0), "calibrated"

    def device_description(self) -> str:
        return f"{self.gpu_key} (analytic x calibration from {self.calibration.device or self.source}, not run)"

    def provenance(self, options: ProfileOptions) -> dict[str, Any]:
        return {"device_time": (f"analytic time times measured factors by op kind from {self.source} "
                                f"(default factor {self.calibration.default:.3g})"),
                "iters": None, "warmup": None}
