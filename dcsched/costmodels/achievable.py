"""Achievable, not peak, throughput: what the analytic cost model prices a matmul, an attention kernel and a
memory-bound op at.

Every figure is a published measurement (or the vendor's), stated with its source beside it; none is fitted
to a training run. Per GPU (:data:`ACHIEVABLE`):

* **Matmuls** (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_grouped_mm``, convolutions) run at the *maximum
  achievable matmul FLOPS* (MAMF) fraction of the tensor-core peak, times the fraction of the GPU's SMs the
  GEMM's output tiles fill (:func:`matmul_fill`): a GEMM with fewer 128x128 output tiles than SMs leaves SMs
  idle (NVIDIA, *Matrix Multiplication Background User's Guide*: tile and wave quantization). Skinny GEMMs
  (a small M, N or K) are bounded by their bytes instead, at the achievable bandwidth below.
* **Attention kernels** (``scaled_dot_product_*``, flash / memory-efficient / cuDNN attention) run at the
  utilisation the FlashAttention papers report for the kernel PyTorch's SDPA ships (FlashAttention-2),
  forward and backward. A causal kernel skips the masked half of the score blocks, so its FLOPs count half
  (as the FlashAttention papers count them).
* **Everything else** is memory-bound: its tensor inputs plus outputs move at the achievable fraction of HBM
  bandwidth (a streaming copy's, not the data sheet's).

>>> h100 = ACHIEVABLE["NVIDIA H100 SXM5 80GB"]
>>> h100.matmul_fraction, h100.bandwidth_fraction, h100.sms
(0.8, 0.85, 132)
>>> matmul_fill(16384, 4096, sms=132), round(matmul_fill(128, 1024, sms=132), 4)  # 8 tiles of 132 SMs
(1.0, 0.0606)
"""

from __future__ import annotations

import dataclasses
import math

#: Output tile of one thread block in cuBLAS's large tensor-core GEMM kernels (NVIDIA's *Matrix
#: Multiplication Background User's Guide* lists 256x128 and 128x128 as its most efficient tiles; the smaller
#: is taken, so that a GEMM is not counted as filling fewer SMs than cuBLAS can give it).
TILE = 128

_MAMF = ("Maximum Achievable Matmul FLOPS (MAMF), bf16, no sparsity (S. Bekman, ml-engineering, "
         "compute/accelerator/README.md, MAMF comparison table, measured with mamf-finder.py)")
_FA2_ON_HOPPER = ("FlashAttention-3 paper (Shah et al. 2024, arXiv:2407.08608), abstract: FlashAttention-2 "
                  "reaches only 35% utilisation on the H100; PyTorch's SDPA flash kernel is FlashAttention-2")
_STREAM = ("streaming HBM access reaches 84-91% of the data sheet: coalesced matrix loads at 2.8 of 3.35 TB/s "
           "on an H100 SXM5 in Nsight Compute (mikamirai.com/blog/gpu-memory-bandwidth); a 4 GiB device copy "
           "at 90.6% of an H100 NVL's 3.94 TB/s; 0.85 taken for every HBM part")


@dataclasses.dataclass(frozen=True)
class Achievable:
    """The fractions of a GPU's peak figures its kernels reach, with the sources of each."""

    #: Best large bf16 GEMM / dense tensor-core peak.
    matmul_fraction: float
    #: Streaming multiprocessors (the data sheet's): what a GEMM's output tiles must fill.
    sms: int
    #: Attention kernel FLOP/s / tensor-core peak, forward and backward.
    attention_forward: float
    attention_backward: float
    #: Achieved / data-sheet HBM bandwidth for a memory-bound kernel.
    bandwidth_fraction: float
    #: Where each figure comes from.
    sources: tuple[str, ...]


#: GPU name (:attr:`dcsched.costmodels.formulas.GPU.name`) -> its achievable fractions.
ACHIEVABLE: dict[str, Achievable] = {
    # MAMF H100 SXM: 792.1 of 989 TFLOP/s (80.1%, CUDA 12.1).
    "NVIDIA H100 SXM5 80GB": Achievable(
        matmul_fraction=0.80, sms=132, attention_forward=0.35, attention_backward=0.35, bandwidth_fraction=0.85,
        sources=(_MAMF + ": H100 SXM 792.1 of 989 TFLOP/s (80.1%)", "132 SMs: NVIDIA H100 data sheet",
                 _FA2_ON_HOPPER + "; the backward is taken at the same fraction", _STREAM)),
    # The H200 is the H100's GH100 die with more and faster HBM: the H100's compute fractions.
    "NVIDIA H200 SXM 141GB": Achievable(
        matmul_fraction=0.80, sms=132, attention_forward=0.35, attention_backward=0.35, bandwidth_fraction=0.85,
        sources=(_MAMF + ": H100/H200 SXM 794.5 of 989 TFLOP/s (80.3%)", "132 SMs: the H100's GH100 die",
                 _FA2_ON_HOPPER + "; the H200's is the H100's die", _STREAM)),
    # MAMF A100 SXM: 267.9 of 312 TFLOP/s (85.9%, CUDA 12.1).
    "NVIDIA A100 SXM4 80GB": Achievable(
        matmul_fraction=0.86, sms=108, attention_forward=0.73, attention_backward=0.63, bandwidth_fraction=0.85,
        sources=(_MAMF + ": A100 SXM 267.9 of 312 TFLOP/s (85.9%)", "108 SMs: NVIDIA A100 data sheet",
                 "FlashAttention-2 paper (Dao 2023, arXiv:2307.08691): up to 73% of the A100's peak forward, "
                 "63% backward", _STREAM)),
}

#: Fractions for a GPU with no row above: the peak figures themselves (the plain roofline).
PEAK = Achievable(matmul_fraction=1.0, sms=1, attention_forward=1.0, attention_backward=1.0,
                  bandwidth_fraction=1.0, sources=("no published fractions: the data sheet's peaks",))


def achievable(gpu_name: str) -> Achievable:
    """The :class:`Achievable` row of the GPU named ``gpu_name``; :data:`PEAK` for a GPU the table lacks."""
    return ACHIEVABLE.get(gpu_name, PEAK)


def matmul_fill(m: int, n: int, *, sms: int, batch: int = 1) -> float:
    """The fraction of ``sms`` a GEMM's ``batch * ceil(m/TILE) * ceil(n/TILE)`` output tiles keep busy (at most 1).

    Non-decreasing in ``m``, ``n`` and ``batch``: a larger GEMM never fills fewer SMs.

    >>> matmul_fill(4096, 4096, sms=132)  # 1024 tiles: every SM busy
    1.0
    >>> matmul_fill(256, 256, sms=132, batch=2) == 8 / 132
    True
    """
    if sms < 1:
        raise ValueError("sms must be at least 1")
    tiles = max(batch, 1) * math.ceil(max(m, 1) / TILE) * math.ceil(max(n, 1) / TILE)
    return min(1.0, tiles / sms)


def matmul_ms(flops: float, bytes_moved: float, *, peak_flops: float, bandwidth: float, fill: float,
              fractions: Achievable) -> float:
    """A GEMM's time (ms): ``max(flops / (peak * matmul_fraction * fill), bytes / (bandwidth * bw_fraction))``.

    >>> row = ACHIEVABLE["NVIDIA H100 SXM5 80GB"]
    >>> round(matmul_ms(2 * 4096**3, 3 * 2 * 4096**2, peak_flops=989e12, bandwidth=3.35e12, fill=1.0,
    ...                 fractions=row), 4)  # bf16 4096^3 at 80% of 989 TFLOP/s
    0.1737
    """
    compute = flops / (peak_flops * fractions.matmul_fraction * fill) if flops else 0.0
    return max(compute, memory_s(bytes_moved, bandwidth=bandwidth, fractions=fractions)) * 1e3


def attention_ms(flops: float, bytes_moved: float, *, peak_flops: float, bandwidth: float, backward: bool,
                 fractions: Achievable) -> float:
    """An attention kernel's time (ms) at the FlashAttention utilisation of its direction (or its bytes').

    >>> row = ACHIEVABLE["NVIDIA H100 SXM5 80GB"]
    >>> round(attention_ms(1e12, 0, peak_flops=989e12, bandwidth=3.35e12, backward=False, fractions=row), 4)
    2.8889
    """
    fraction = fractions.attention_backward if backward else fractions.attention_forward
    compute = flops / (peak_flops * fraction) if flops else 0.0
    return max(compute, memory_s(bytes_moved, bandwidth=bandwidth, fractions=fractions)) * 1e3


def memory_bound_ms(flops: float, bytes_moved: float, *, peak_flops: float, bandwidth: float,
                    fractions: Achievable) -> float:
    """A memory-bound op's time (ms): its bytes at the achievable bandwidth (or its FLOPs at the peak's
    achievable fraction, where those take longer).

    >>> row = ACHIEVABLE["NVIDIA H100 SXM5 80GB"]
    >>> round(memory_bound_ms(0, 1e9, peak_flops=989e12, bandwidth=3.35e12, fractions=row), 4)  # 1 GB at 85%
    0.3512
    """
    compute = flops / (peak_flops * fractions.matmul_fraction) if flops else 0.0
    return max(compute, memory_s(bytes_moved, bandwidth=bandwidth, fractions=fractions)) * 1e3


def memory_s(bytes_moved: float, *, bandwidth: float, fractions: Achievable) -> float:
    """Seconds to move ``bytes_moved`` through HBM at the achievable fraction of ``bandwidth`` (bytes/s)."""
    return bytes_moved / (bandwidth * fractions.bandwidth_fraction) if bytes_moved else 0.0
