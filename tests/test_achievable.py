"""The analytic cost model's achievable rates: matmuls by shape, attention at FlashAttention's utilisation,
memory-bound ops at the achievable HBM bandwidth (dcsched/costmodels/achievable.py), checked against figures
worked by hand from the published constants."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcsched.costmodels import achievable as ach
from dcsched.costmodels.analytic import op_time_ms
from dcsched.costmodels.formulas import GPUS

aten = torch.ops.aten
H100, A100 = GPUS["h100"], GPUS["a100"]


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _mm_ms(m: int, k: int, n: int, gpu=H100) -> float:
    flops = 2 * m * k * n
    moved = 2 * (m * k + k * n + m * n)
    return op_time_ms(aten.mm.default, (_meta(m, k), _meta(k, n)), {}, flops, moved, torch.bfloat16, gpu)


def _efficiency(m: int, k: int, n: int, gpu=H100) -> float:
    return 2 * m * k * n / (_mm_ms(m, k, n, gpu) * 1e-3) / gpu.tensor16_flops


def test_a_large_gemm_runs_at_the_published_mamf_fraction():
    # 16384 x 4096 x 14336 (a Llama 3 8B MLP matmul at 2 x 8192 tokens): every SM busy, compute-bound, so
    # 80% of 989 TFLOP/s, by hand: 2 * 16384 * 4096 * 14336 / (0.8 * 989e12) s.
    assert _mm_ms(16384, 4096, 14336) == pytest.approx(2 * 16384 * 4096 * 14336 / (0.8 * 989e12) * 1e3)
    assert _efficiency(16384, 4096, 14336) == pytest.approx(0.80)
    assert _efficiency(16384, 4096, 14336, A100) == pytest.approx(0.86)


def test_small_and_skinny_gemms_run_far_below_peak():
    # 256 x 256 output: 4 tiles of 132 SMs, 4/132 of the 80%.
    assert _efficiency(256, 4096, 256) == pytest.approx(0.8 * 4 / 132)
    # A skinny GEMM (M = 16) is bound by its weight's bytes at 85% of 3.35 TB/s.
    moved = 2 * (16 * 8192 + 8192 * 8192 + 16 * 8192)
    assert _mm_ms(16, 8192, 8192) == pytest.approx(moved / (0.85 * 3.35e12) * 1e3)
    assert _efficiency(16, 8192, 8192) < 0.05


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 7), st.integers(0, 7), st.integers(0, 7), st.sampled_from(["m", "k", "n"]))
def test_gemm_efficiency_never_falls_as_a_dimension_grows(m_exp, k_exp, n_exp, grown):
    m, k, n = 16 << m_exp, 16 << k_exp, 16 << n_exp
    bigger = {"m": (2 * m, k, n), "k": (m, 2 * k, n), "n": (m, k, 2 * n)}[grown]
    assert _efficiency(*bigger) >= _efficiency(m, k, n) * (1 - 1e-12)


def test_square_gemm_efficiency_rises_to_the_plateau():
    curve = [_efficiency(size, size, size) for size in (128, 256, 512, 1024, 2048, 4096, 8192)]
    assert curve == sorted(curve) and curve[0] < 0.05 and curve[-1] == pytest.approx(0.80)


def test_memory_bound_ops_move_bytes_at_the_documented_fraction():
    x = _meta(2, 8192, 4096)
    moved = 3 * x.numel() * 2  # two inputs and one output, bf16
    ms = op_time_ms(aten.add.Tensor, (x, x), {}, 0, moved, torch.bfloat16, H100)
    assert ms == pytest.approx(moved / (0.85 * 3.35e12) * 1e3)
    assert ach.ACHIEVABLE[H100.name].bandwidth_fraction == 0.85


def test_causal_attention_counts_half_its_flops_at_flashattention_utilisation():
    q = _meta(2, 32, 8192, 128)
    flops = 4 * 2 * 32 * 8192 * 8192 * 128  # q @ k^T and p @ v, 2 FLOPs per multiply-add
    target = aten._scaled_dot_product_flash_attention_for_cpu.default
    full = op_time_ms(target, (q, q, q), {}, flops, 0, torch.bfloat16, H100)
    causal = op_time_ms(target, (q, q, q, 0.0, True), {}, flops, 0, torch.bfloat16, H100)
    assert full == pytest.approx(flops / (0.35 * 989e12) * 1e3)
    assert causal == pytest.approx(full / 2)
    backward = op_time_ms(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, (), {}, flops, 0,
                          torch.bfloat16, A100)
    assert backward == pytest.approx(flops / (0.63 * 312e12) * 1e3)  # FlashAttention-2's A100 backward


def test_every_gpu_has_sourced_fractions_below_one():
    assert set(ach.ACHIEVABLE) == {gpu.name for gpu in GPUS.values()}
    for row in ach.ACHIEVABLE.values():
        for fraction in (row.matmul_fraction, row.attention_forward, row.attention_backward, row.bandwidth_fraction):
            assert 0 < fraction < 1
        assert row.sources and all(source.strip() for source in row.sources)
    assert ach.achievable("an unlisted GPU") is ach.PEAK


def test_matmul_fill_rejects_no_sms():
    with pytest.raises(ValueError, match="sms"):
        ach.matmul_fill(128, 128, sms=0)
