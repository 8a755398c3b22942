"""The formulas behind the cost models: communication time from bytes, a roofline from FLOPs and bytes, the GPU table.

Communication (one process standing in for W ranks): moving ``nbytes`` through
an all-gather or a reduce-scatter over W ranks takes

    time = nbytes * (W - 1) / W / bandwidth + latency

with ``bandwidth`` in GB/s (10^9 bytes per second) and ``latency`` in
microseconds; the result is in milliseconds.

>>> round(comm_time_ms(10**9, world_size=8, bandwidth_gbps=100.0, latency_us=20.0), 6)
8.77
>>> comm_time_ms(4096, world_size=1, bandwidth_gbps=100.0, latency_us=0.0)
0.0

Compute (``--cost-model analytic``): a roofline, ``max(flops / peak_flops,
bytes_moved / memory_bandwidth)``, where FLOPs come from
``torch.utils.flop_counter``'s formulas (matrix multiplies, convolutions,
attention) and bytes moved are the bytes of a node's tensor inputs and outputs.
The roofline is a lower bound: real kernels reach a fraction of peak.

>>> h100 = GPUS["h100"]
>>> round(roofline_ms(2 * 4096**3, 3 * 4096 * 4096 * 2, torch.bfloat16, h100), 4)  # bf16 4096^3 matmul
0.139
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class GPU:
    """Peak figures of one GPU (dense, no sparsity), from NVIDIA's data sheets (SXM parts).

    ``memory_bytes`` is the total memory ``nvidia-smi`` reports for the part.
    """

    name: str
    #: FLOP/s on tensor cores for 16-bit floats (bf16/fp16), dense.
    tensor16_flops: float
    #: FLOP/s for float32 without TF32 (PyTorch's default for matmuls).
    fp32_flops: float
    #: FLOP/s for float64.
    fp64_flops: float
    #: HBM bandwidth in bytes per second.
    memory_bandwidth: float
    memory_bytes: int

    def peak_flops(self, dtype: torch.dtype) -> float:
        if dtype in (torch.bfloat16, torch.float16):
            return self.tensor16_flops
        if dtype == torch.float64:
            return self.fp64_flops
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return 2 * self.tensor16_flops
        return self.fp32_flops


_MiB = 2**20

#: The GPUs ``--gpu`` accepts. Sources: NVIDIA H100 SXM5, A100 SXM4 80GB and H200 SXM data sheets.
GPUS: dict[str, GPU] = {
    "h100": GPU("NVIDIA H100 SXM5 80GB", tensor16_flops=989e12, fp32_flops=67e12, fp64_flops=67e12,
                memory_bandwidth=3.35e12, memory_bytes=81559 * _MiB),
    "a100": GPU("NVIDIA A100 SXM4 80GB", tensor16_flops=312e12, fp32_flops=19.5e12, fp64_flops=19.5e12,
                memory_bandwidth=2.039e12, memory_bytes=81920 * _MiB),
    "h200": GPU("NVIDIA H200 SXM 141GB", tensor16_flops=989e12, fp32_flops=67e12, fp64_flops=67e12,
                memory_bandwidth=4.8e12, memory_bytes=143771 * _MiB),
}


def gpu(name: str) -> GPU:
    """The :class:`GPU` for ``'h100'``, ``'a100'`` or ``'h200'`` (case-insensitive)."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r} (choose from {', '.join(GPUS)})") from None


def comm_time_ms(nbytes: int, *, world_size: int, bandwidth_gbps: float, latency_us: float) -> float:
    """Time (ms) of an all-gather / reduce-scatter moving ``nbytes`` (the full tensor) over ``world_size`` ranks.

    ``nbytes * (W-1)/W / bandwidth + latency``; 0 for world size 1 without latency.
    """
    if world_size < 1:
        raise ValueError("world size must be at least 1")
    if bandwidth_gbps <= 0:
        raise ValueError("bandwidth must be positive (GB/s)")
    if latency_us < 0:
        raise ValueError("latency must not be negative (us)")
    moved = nbytes * (world_size - 1) / world_size
    return moved / (bandwidth_gbps * 1e9) * 1e3 + latency_us * 1e-3


def roofline_ms(flops: float, bytes_moved: float, dtype: torch.dtype, device: GPU) -> float:
    """``max(flops / peak(dtype), bytes_moved / memory_bandwidth)`` in milliseconds."""
    compute = flops / device.peak_flops(dtype) if flops else 0.0
    memory = bytes_moved / device.memory_bandwidth if bytes_moved else 0.0
    return max(compute, memory) * 1e3


# ---------------------------------------------------------------------------
# FLOPs of one aten call
# ---------------------------------------------------------------------------

def _shape(value):
    return tuple(value.shape) if isinstance(value, torch.Tensor) else value


def node_flops(target, args, kwargs, out) -> int:
    """FLOPs of ``target(*args, **kwargs) -> out`` by ``torch.utils.flop_counter``'s formulas (0 if none)."""
    from torch.utils import flop_counter

    packet = getattr(target, "overloadpacket", None)
    formula = flop_counter.flop_registry.get(packet) if packet is not None else None
    if formula is not None:
        try:
            return int(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not fit this overload's arguments: count nothing
            return 0
    name = getattr(target, "__name__", "")
    # The CPU flash-attention kernels have no registered formula; they compute what the GPU ones do.
    if name.startswith("_scaled_dot_product_flash_attention_for_cpu_backward"):
        return int(flop_counter.sdpa_backward_flop_count(_shape(args[0]), _shape(args[1]), _shape(args[2]),
                                                         _shape(args[3])))
    if name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
        return int(flop_counter.sdpa_flop_count(_shape(args[0]), _shape(args[1]), _shape(args[2])))
    return 0
