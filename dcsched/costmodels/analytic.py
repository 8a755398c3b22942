"""``analytic``: nothing runs; each node's time for a named GPU from its FLOPs and bytes moved, at achievable rates.

FLOPs come from ``torch.utils.flop_counter``'s formulas, bytes are the node's
tensor inputs plus outputs (:mod:`dcsched.costmodels.formulas`), and each kind
of op runs at the fraction of the GPU's peak that published measurements
report for it (:mod:`dcsched.costmodels.achievable`): a matmul at the maximum
achievable matmul FLOPS times the share of SMs its output tiles fill, an
attention kernel at FlashAttention's utilisation (causal: half the FLOPs),
every other op at the achievable HBM bandwidth; each is bounded below by its
bytes at that bandwidth. Views and ``getitem`` cost 0. Deterministic and pure,
so it suits shipped samples.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from dcsched.errors import OptionError
from dcsched.graph.roles import is_view_like
from dcsched.graph.specs import nbytes, node_bytes, node_specs
from dcsched.costmodels.base import StaticCostModel
from dcsched.costmodels.achievable import achievable, attention_ms, matmul_fill, matmul_ms, memory_bound_ms
from dcsched.costmodels.formulas import GPU, GPUS, node_flops
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


#: Ops priced as GEMMs (tensor-core matmuls and convolutions), by overload packet name.
MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "convolution",
                     "convolution_backward", "_convolution"})
#: Name fragments of the attention kernels (SDPA's flash, memory-efficient, cuDNN and CPU flash kernels).
ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


def op_name(target) -> str:
    """``mm`` for ``aten.mm.default``: the overload packet's name, else the callable's name."""
    packet = getattr(target, "overloadpacket", None)
    return str(getattr(packet, "__name__", "")) if packet is not None else str(getattr(target, "__name__", ""))


def schema_argument(target, args, kwargs, name: str, default=None):
    """The value of the argument ``name`` of a call of the op ``target`` (its schema default where not
    passed; ``default`` without a schema or such an argument)."""
    schema = getattr(target, "_schema", None)
    for i, argument in enumerate(getattr(schema, "arguments", ())):
        if argument.name == name:
            if name in kwargs:
                return kwargs[name]
            if i < len(args):
                return args[i]
            return argument.default_value if argument.has_default_value() else default
    return default


def gemm_tiles(name: str, args) -> tuple[int, int, int] | None:
    """``(m, n, batch)`` of a matmul's output, the dimensions its tiles cover; None for ops whose output is not
    one GEMM's (convolutions, grouped GEMMs), which are taken to fill the GPU.

    >>> gemm_tiles("addmm", (None, torch.empty(64, 32, device="meta"), torch.empty(32, 16, device="meta")))
    (64, 16, 1)
    >>> gemm_tiles("convolution", ()) is None
    True
    """
    def shape(value) -> tuple[int, ...]:
        return tuple(value.shape) if hasattr(value, "shape") else ()
    operands = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2)}.get(name)
    if operands is None:
        return None
    a, b = (shape(args[i]) if i < len(args) else () for i in operands)
    if len(a) < 2 or len(b) < 2:
        return None
    return int(a[-2]), int(b[-1]), int(math.prod(a[:-2]))


def analytic_time(node: torch.fx.Node, device: GPU) -> float:
    """Time (ms) of a compute node on ``device`` at achievable rates, from its recorded shapes; views and
    getitems cost 0 (see the module docstring)."""
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
    return op_time_ms(node.target, args, kwargs, flops, read + written, dtype, device)


def op_time_ms(target, args, kwargs, flops: float, bytes_moved: float, dtype: torch.dtype, device: GPU) -> float:
    """Time (ms) of one call of ``target`` doing ``flops`` and moving ``bytes_moved``, priced by its kind."""
    fractions = achievable(device.name)
    peak, bandwidth = device.peak_flops(dtype), device.memory_bandwidth
    name = op_name(target)
    if name in MATMULS:
        tiles = gemm_tiles(name, args)
        fill = 1.0 if tiles is None else matmul_fill(tiles[0], tiles[1], sms=fractions.sms, batch=tiles[2])
        return matmul_ms(flops, bytes_moved, peak_flops=peak, bandwidth=bandwidth, fill=fill, fractions=fractions)
    if any(fragment in name for fragment in ATTENTION):
        if schema_argument(target, args, kwargs, "is_causal", False) is True:
            flops = flops / 2  # the masked half of the score blocks is skipped
        return attention_ms(flops, bytes_moved, peak_flops=peak, bandwidth=bandwidth,
                            backward=name.endswith("_backward"), fractions=fractions)
    return memory_bound_ms(flops, bytes_moved, peak_flops=peak, bandwidth=bandwidth, fractions=fractions)


def target_gpu(options: ProfileOptions, model: str) -> GPU:
    """The GPU ``options.gpu`` names; the static models cannot do without one."""
    if options.gpu is None:
        raise OptionError("gpu", f"is missing: the {model} cost model needs a target GPU ({', '.join(GPUS)})")
    return GPUS[options.gpu.lower()]


@register
class AnalyticCostModel(StaticCostModel):
    name = "analytic"
    description = ("a named GPU's achievable rates from FLOPs and bytes: matmuls at MAMF x SM fill, attention at "
                   "FlashAttention utilisation, other ops at achievable HBM bandwidth")

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
        return {"device_time": "analytic at achievable rates: max(flops / (peak x published fraction), "
                               "bytes / (bandwidth x published fraction))",
                "iters": None, "warmup": None}
