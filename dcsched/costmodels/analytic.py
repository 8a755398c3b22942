"""``analytic``: nothing runs; a roofline for a named GPU from each node's FLOPs and bytes moved.

Each compute node's time is ``max(flops / peak, bytes / memory bandwidth)``:
FLOPs from ``torch.utils.flop_counter``'s formulas, bytes = its tensor inputs
plus outputs (:mod:`dcsched.costmodels.formulas`). Views and ``getitem`` cost
0. Deterministic, so it suits shipped samples; a lower bound (real kernels
reach a fraction of peak).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from dcsched.errors import OptionError
from dcsched.graph.roles import is_view_like
from dcsched.graph.specs import nbytes, node_bytes, node_specs
from dcsched.costmodels.base import StaticCostModel
from dcsched.costmodels.formulas import GPU, GPUS, node_flops, roofline_ms
from dcsched.costmodels.registry import register

if TYPE_CHECKING:
    from dcsched.costmodels.options import ProfileOptions


def _as_meta(node_or_value):
    """A node's recorded output as meta tensors (a tuple for multi-output nodes); other values as they are."""
    if isinstance(node_or_value, torch.fx.Node):
        specs = node_specs(node_or_value)
        recorded = node_or_value.meta.get("val", node_or_value.meta.get("out"))
        if len(specs) == 1 and not isinstance(recorded, (list, tuple)):
            return torch.empty(specs[0][0], dtype=specs[0][1], device="meta")
        return tuple(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in specs)
    return node_or_value


def analytic_time(node: torch.fx.Node, device: GPU) -> float:
    """Roofline time (ms) of a compute node from its recorded shapes; views and getitems cost 0."""
    if node.op != "call_function" or is_view_like(node):
        return 0.0
    args = torch.fx.node.map_arg(node.args, _as_meta)
    kwargs = torch.fx.node.map_arg(node.kwargs, _as_meta)
    outs = node_specs(node)
    flops = node_flops(node.target, args, kwargs, _as_meta(node))
    read = sum(node_bytes(n) for n in node.all_input_nodes)
    written = sum(nbytes(shape, dtype) for shape, dtype in outs)
    dtypes = [dtype for _, dtype in outs if dtype.is_floating_point] or [
        dtype for n in node.all_input_nodes for _, dtype in node_specs(n) if dtype.is_floating_point]
    dtype = dtypes[0] if dtypes else torch.float32
    return roofline_ms(flops, read + written, dtype, device)


def target_gpu(options: ProfileOptions, model: str) -> GPU:
    """The GPU ``options.gpu`` names; the static models cannot do without one."""
    if options.gpu is None:
        raise OptionError("gpu", f"is missing: the {model} cost model needs a target GPU ({', '.join(GPUS)})")
    return GPUS[options.gpu.lower()]


@register
class AnalyticCostModel(StaticCostModel):
    name = "analytic"
    description = "roofline for a named GPU from FLOPs and bytes: max(flops/peak, bytes/memory bandwidth)"

    def __init__(self, gpu: GPU, gpu_key: str) -> None:
        self.gpu, self.gpu_key = gpu, gpu_key

    @classmethod
    def from_options(cls, options: ProfileOptions) -> AnalyticCostModel:
        gpu = target_gpu(options, cls.name)  # raises when options.gpu is None
        return cls(gpu, str(options.gpu).lower())

    def target_gpu(self, options: ProfileOptions) -> GPU:
        return self.gpu

    def interconnect_kind(self, options: ProfileOptions) -> str:
        return self.gpu_key

    def compute_time(self, node: torch.fx.Node) -> tuple[float, str]:
        return analytic_time(node, self.gpu), "analytic"

    def device_description(self) -> str:
        return f"{self.gpu_key} (analytic, not run)"

    def provenance(self, options: ProfileOptions) -> dict[str, Any]:
        return {"device_time": "analytic roofline max(flops/peak, bytes/memory bandwidth)",
                "iters": None, "warmup": None}
