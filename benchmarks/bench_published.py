"""Predict published training runs: torchtitan's Llama 3.1 8B on H100s, planned from shapes, beside its figures.

The published runs (torchtitan, ``docs/performance.md``, now ``benchmarks/llama3_h100_202412_torchtitan.md``;
torchtitan 9dec370, torch 1963fc8, December 2024): Llama 3.1 8B, local batch 2, sequence 8192, bf16 mixed
precision (FSDP2 ``param_dtype`` bf16, ``reduce_dtype`` fp32), selective activation checkpointing with
torchtitan's ``op`` policy (``train_configs/llama3_8b.toml``: ``mode = 'selective'``,
``selective_ac_option = 'op'``), AdamW, on Grand Teton hosts of 8 H100s (96 GB HBM2e at 2.4 TB/s, 500 W,
NVLink within a host, 400 Gb/s RDMA per GPU between hosts). Memory is torchtitan's device memory monitor's
``max_reserved_gib``: ``torch.cuda.memory_stats()["reserved_bytes.all.peak"]``, the caching allocator's peak
reserved bytes (``train.py`` logs it; ``max_active`` is read too but not printed).

What runs: the training script below (torchtitan's Llama 3 model with its 8B shapes, in plain PyTorch, random
init, nothing downloaded) is captured in a fresh process by ``dcsched profile --meta --cost-model analytic
--gpu h100``; the bundle is priced again by the analytic model (:mod:`dcsched.costmodels.achievable`) for
each published world size, with the HBM bandwidth of the run's H100 (2.4 TB/s, published; its tensor-core
peak is unpublished, "between SXM and NVL", so the SXM5's 989 TFLOP/s stays), and planned with ``fsdp`` (as
FSDP2 runs it) and ``overlap-plan``. Predicted tokens/s per GPU = local tokens / (simulated forward +
backward step + the AdamW step over the rank's fp32 shard at the achievable bandwidth). Predicted memory =
the whole step's peak per rank (:func:`dcsched.sim.step_memory.step_memory` under each algorithm's plans,
AdamW, with the run's fp32 master shards: :func:`under_the_runs_policy`), costed by
the CUDA caching allocator simulated over two steps' allocations and frees
(:mod:`dcsched.sim.caching_allocator`): its reserved bytes, the model of ``reserved_bytes.all.peak``.

    python benchmarks/bench_published.py                          # capture (2-5 minutes here) and plan
    python benchmarks/bench_published.py --keep /tmp/llama8b.pt   # ... and keep the captured bundle
    python benchmarks/bench_published.py --bundle /tmp/llama8b.pt # plan a kept capture again (a minute)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: The published source of every row.
TORCHTITAN = ("torchtitan docs/performance.md (benchmarks/llama3_h100_202412_torchtitan.md), "
              "torchtitan 9dec370 / torch 1963fc8, 2024-12")
#: HBM bandwidth of the runs' H100s ("96GB HBM2e with 2.4 TB/sec peak memory bandwidth", the same page).
RUN_HBM_BANDWIDTH = 2.4e12
LOCAL_BATCH, SEQUENCE = 2, 8192
#: AdamW's step reads the fp32 parameter, gradient and both moments and writes the parameter and the moments
#: (7 x 4 bytes per parameter); gradient clipping (torchtitan's max_norm 1.0) reads the gradient once more.
OPTIMIZER_BYTES_PER_PARAM = 8 * 4


@dataclasses.dataclass(frozen=True)
class Published:
    """One published row: its label, cluster, and figures."""

    label: str
    world_size: int
    tokens_per_gpu: float
    memory_gib: float
    table: str


ROWS = (
    Published("FSDP, 8 GPUs", 8, 5762, 82.4, "Table 1"),
    Published("FSDP + torch.compile, 8 GPUs", 8, 6667, 77.0, "Table 1"),
    Published("FSDP, 128 GPUs", 128, 5605, 67.0, "Table 3"),
    Published("FSDP + torch.compile, 128 GPUs", 128, 6514, 62.0, "Table 3"),
)

#: torchtitan's Llama 3.1 8B, written as torchtitan's ``torchtitan/models/llama/model.py`` (9dec370) builds it:
#: ``ModelArgs`` "8B" (dim 4096, 32 layers, 32 heads, 8 KV heads repeated to 32 before SDPA, ffn_dim_multiplier
#: 1.3 and multiple_of 1024 -> 14336, vocabulary 128256, rope theta 500000, RMSNorm eps 1e-5, untied output),
#: SDPA with ``is_causal=True``, cross entropy on the fp32 logits; random init, in bf16 (FSDP2's param_dtype).
#: The rotary embedding is applied in real arithmetic (cos / sin tables) rather than torchtitan's complex
#: multiply: the same elementwise work, in ops a bundle holds. Every block is checkpointed with torchtitan's
#: selective ``op`` policy: save the outputs of mm (all but every second one, counted per block and per forward
#: / recompute), of the SDPA kernels (the CPU flash kernel the meta capture traces stands for the GPU's flash
#: kernel) and of abs / max; recompute the rest.
SCRIPT = """
    import collections
    import functools
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    DIM, LAYERS, HEADS, KV_HEADS, FFN, VOCAB, THETA = 4096, {layers}, 32, 8, 14336, 128256, 500000.0
    HEAD_DIM = DIM // HEADS
    aten = torch.ops.aten
    SAVED = {{aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default, aten.abs.default, aten.max.default}}

    def policy(counts, ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            counts[mode] += 1
        save = func in SAVED and not (func == aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    def context():
        return create_selective_checkpoint_contexts(functools.partial(policy, collections.Counter()))

    class RMSNorm(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight

    def rotate(x, cos, sin):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm, self.ffn_norm = RMSNorm(DIM), RMSNorm(DIM)
            self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
            self.wk = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
            self.wv = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
            self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
            self.w1 = nn.Linear(DIM, FFN, bias=False)
            self.w2 = nn.Linear(FFN, DIM, bias=False)
            self.w3 = nn.Linear(DIM, FFN, bias=False)

        def forward(self, x, cos, sin):
            b, s, _ = x.shape
            h = self.attention_norm(x)
            q = self.wq(h).view(b, s, HEADS, HEAD_DIM)
            k = self.wk(h).view(b, s, KV_HEADS, HEAD_DIM)
            v = self.wv(h).view(b, s, KV_HEADS, HEAD_DIM)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            repeat = HEADS // KV_HEADS  # torchtitan's repeat_kv
            k = k[:, :, :, None, :].expand(b, s, KV_HEADS, repeat, HEAD_DIM).reshape(b, s, HEADS, HEAD_DIM)
            v = v[:, :, :, None, :].expand(b, s, KV_HEADS, repeat, HEAD_DIM).reshape(b, s, HEADS, HEAD_DIM)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True)
            x = x + self.wo(out.transpose(1, 2).reshape(b, s, DIM))
            h = self.ffn_norm(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
            self.norm = RMSNorm(DIM)
            self.output = nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, tokens, labels):
            s = tokens.shape[1]
            inv = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
            angles = torch.outer(torch.arange(s).float(), inv)[None, :, None, :]
            cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = checkpoint(layer, h, cos, sin, use_reentrant=False, context_fn=context)
            logits = self.output(self.norm(h))
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

    model = Transformer().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters())
    compiled = torch.compile(model)
    tokens = torch.randint(0, VOCAB, ({batch}, {seq} + 1))
    compiled(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()).backward()
    optimizer.step()
"""


def capture(layers: int, out: Path) -> float:
    """Capture the script with ``layers`` blocks into ``out`` in a fresh process; the seconds it took."""
    script = out.with_suffix(".py")
    script.write_text(textwrap.dedent(SCRIPT.format(layers=layers, seq=SEQUENCE, batch=LOCAL_BATCH)))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "dcsched", "profile", str(script), "-o", str(out), "--meta",
                           "--force", "--cost-model", "analytic", "--gpu", "h100", "--world-size", "8",
                           "--master-dtype", "fp32", "--reduce-dtype", "fp32", "--no-progress"],
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise SystemExit(f"capture failed: {lines[-1] if lines else done.returncode}")
    return time.perf_counter() - start


def priced(bundle, world_size: int, bandwidth: float | None):
    """``bundle`` priced by the analytic model for an H100 at ``world_size``; ``bandwidth`` (bytes/s), where
    given, replaces the data sheet's HBM bandwidth in every compute node's time."""
    from dcsched.costmodels.analytic import analytic_time
    from dcsched.costmodels.formulas import GPUS
    from dcsched.costmodels.options import ProfileOptions
    from dcsched.graph.roles import Role, role_of
    from dcsched.profile.measure import profile_bundle

    profiled = profile_bundle(bundle, ProfileOptions(cost_model="analytic", gpu="h100", world_size=world_size,
                                                     progress=False))
    if bandwidth is not None:
        gpu = dataclasses.replace(GPUS["h100"], memory_bandwidth=bandwidth)
        for graph in profiled.graphs.values():
            for node in graph.nodes:
                if role_of(node) is Role.COMPUTE and node.op == "call_function":
                    node.meta["device_time"] = analytic_time(node, gpu)
    return profiled


def compute_by_kind(bundle) -> dict[str, float]:
    """Compute ms of the step by op kind: ``matmul``, ``attention``, ``memory-bound``."""
    from dcsched.costmodels.analytic import ATTENTION, MATMULS, op_name
    from dcsched.graph.roles import Role, role_of

    kinds = {"matmul": 0.0, "attention": 0.0, "memory-bound": 0.0}
    for graph in bundle.graphs.values():
        for node in graph.nodes:
            if role_of(node) is not Role.COMPUTE or node.op != "call_function":
                continue
            name = op_name(node.target)
            kind = ("matmul" if name in MATMULS else
                    "attention" if any(fragment in name for fragment in ATTENTION) else "memory-bound")
            kinds[kind] += float(node.meta.get("device_time", 0.0))
    return kinds


def under_the_runs_policy(bundle):
    """``bundle`` as the published run holds it: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)`` over fp32 master weights (:func:`dcsched.train.mixed_precision.with_master_dtype`).

    The capture applies it (``dcsched profile --master-dtype fp32 --reduce-dtype fp32``): the script is bf16
    throughout (``model.to(torch.bfloat16)``), so the shards, AdamW's states and the reduced gradients are fp32
    only under the policy, and each bf16 gradient is cast to fp32 before its reduce-scatter. A kept capture that
    records no policy (made without those options) gets it here, before it is priced again; one that does is
    returned as it is.
    """
    if "mixed_precision" not in bundle.provenance:
        import torch

        from dcsched.train.mixed_precision import with_master_dtype
        with_master_dtype(bundle, torch.float32, torch.float32)
    return bundle


def predicted_peak(bundle, plans: dict):
    """The whole step's memory per rank that the benchmark compares with the published max-reserved figure:
    :func:`~dcsched.sim.step_memory.step_memory` of the bundle with fp32 master shards
    (:func:`under_the_runs_policy`), run as ``plans`` say, AdamW's states, on a GPU (the CUDA caching
    allocator simulated over the step's allocations and frees). Its ``cuda.reserved_bytes`` is the prediction
    of ``reserved_bytes.all.peak``; ``cuda.packed_reserved_bytes`` the peak's tensors packed perfectly into
    segments (a lower bound)."""
    from dcsched.sim.step_memory import step_memory

    return step_memory(bundle, "adamw", gpu=True, plans=plans)


#: What the predicted peak is, printed beside its column.
PEAK_LABEL = "whole step, fp32 master shards and AdamW states, CUDA caching allocator simulated: reserved"


def plan(bundle, algorithms: tuple[str, ...], optimizer_ms: float, *, memory: bool = True) -> dict[str, dict]:
    """Per algorithm: step ms (forward + backward + optimizer), its compute / communication split, and (with
    ``memory``) the whole step's predicted peak (reserved bytes) and its parts by kind."""
    from dcsched.report.compare import compare_bundle

    comparison = compare_bundle(bundle, algorithms)
    report = comparison.to_dict()
    out = {}
    for algo in algorithms:
        graphs = [graph["after"][algo] for graph in report["graphs"].values()]
        step = sum(g["step_ms"] for g in graphs) + optimizer_ms
        out[algo] = {"step_ms": step, "compute_ms": sum(g["compute_ms"] for g in graphs),
                     "comm_ms": sum(g["comm_ms"] for g in graphs),
                     "exposed_comm_ms": sum(g["exposed_comm_ms"] for g in graphs), "optimizer_ms": optimizer_ms,
                     "tokens_per_gpu": LOCAL_BATCH * SEQUENCE / (step / 1e3),
                     "graph_peak_bytes": max(g["peak_bytes"] for g in graphs)}
        if memory:
            plans = {name: cmp.plans[algo] for name, cmp in comparison.graphs.items() if algo in cmp.plans}
            peak = predicted_peak(bundle, plans)
            assert peak.cuda is not None  # gpu=True
            out[algo].update(peak_bytes=peak.cuda.reserved_bytes, allocated_bytes=peak.cuda.allocated_bytes,
                             packed_bytes=peak.cuda.packed_reserved_bytes,
                             live_bytes=peak.peak_bytes, peak_phase=peak.phase, peak_parts=dict(peak.parts),
                             phases=dict(peak.phases))
    return out


def parameters(bundle) -> int:
    return sum(p.numel for p in bundle.params)


def optimizer_ms(bundle, world_size: int, bandwidth: float) -> float:
    """AdamW (and clipping) over the rank's fp32 shard, at the achievable fraction of ``bandwidth``."""
    from dcsched.costmodels.achievable import achievable, memory_s
    from dcsched.costmodels.formulas import GPUS

    shard_bytes = -(-parameters(bundle) // world_size) * OPTIMIZER_BYTES_PER_PARAM
    return memory_s(shard_bytes, bandwidth=bandwidth, fractions=achievable(GPUS["h100"].name)) * 1e3


def evaluate(bundle, algorithms=("fsdp", "overlap-plan")) -> list[dict]:
    """Every published row beside its predictions (the run's HBM, and the H100 SXM5 table's)."""
    from dcsched.costmodels.formulas import GPUS

    by_world: dict[int, dict] = {}
    for world_size in sorted({row.world_size for row in ROWS}):
        run = priced(bundle, world_size, RUN_HBM_BANDWIDTH)
        table = priced(bundle, world_size, None)
        by_world[world_size] = {
            "run": plan(run, algorithms, optimizer_ms(bundle, world_size, RUN_HBM_BANDWIDTH)),
            "sxm5": plan(table, ("fsdp",), optimizer_ms(bundle, world_size, GPUS["h100"].memory_bandwidth),
                         memory=False),
            "compute_by_kind": compute_by_kind(run)}
    rows = []
    for row in ROWS:
        figures = by_world[row.world_size]
        rows.append({"row": row.label, "table": row.table, "world_size": row.world_size,
                     "published_tokens_per_gpu": row.tokens_per_gpu, "published_memory_gib": row.memory_gib,
                     "published_step_ms": LOCAL_BATCH * SEQUENCE / row.tokens_per_gpu * 1e3, **figures})
    return rows


def error(predicted: float, published: float) -> str:
    return f"{(predicted - published) / published:+.1%}"


#: The memory kinds the breakdown prints, with their short headers (:data:`dcsched.sim.step_memory.KINDS`).
KIND_HEADERS = (("parameter_shards", "param shards"), ("gradient_shards", "grad shards"),
                ("optimizer_states", "AdamW states"), ("optimizer_temporaries", "update temps"),
                ("mixed_precision_copies", "mp copies"), ("gathered_parameters", "gathered params"),
                ("activations", "activations"), ("collective_buffers", "coll. buffers"))


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f}"


def render(rows: list[dict]) -> str:
    lines = [f"Llama 3.1 8B, local batch {LOCAL_BATCH}, sequence {SEQUENCE}, bf16, selective op AC, AdamW; "
             f"source: {TORCHTITAN}",
             f"predicted peak memory: {PEAK_LABEL}; published memory: max reserved (torch.cuda.memory_stats "
             "reserved_bytes.all.peak)", "",
             "| row | W | predicted tok/s/GPU (fsdp) | published | error | predicted peak GiB (fsdp) "
             "| published GiB | error | overlap-plan tok/s/GPU | overlap-plan peak GiB | fsdp tok/s/GPU, SXM5 table |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        fsdp, ours, sxm5 = r["run"]["fsdp"], r["run"]["overlap-plan"], r["sxm5"]["fsdp"]
        lines.append(
            f"| {r['row']} | {r['world_size']} | {fsdp['tokens_per_gpu']:,.0f} | {r['published_tokens_per_gpu']:,.0f} "
            f"| {error(fsdp['tokens_per_gpu'], r['published_tokens_per_gpu'])} | {gib(fsdp['peak_bytes'])} "
            f"| {r['published_memory_gib']} | {error(fsdp['peak_bytes'] / 2**30, r['published_memory_gib'])} "
            f"| {ours['tokens_per_gpu']:,.0f} | {gib(ours['peak_bytes'])} | {sxm5['tokens_per_gpu']:,.0f} |")
    lines += ["", "Where each row's step goes (fsdp, ms; implied compute = published step - predicted exposed "
              "communication - optimizer):", "",
              "| row | published step | predicted step | compute | matmul | attention | memory-bound | implied compute "
              "| compute error | comm | exposed comm | optimizer |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        fsdp, kinds = r["run"]["fsdp"], r["compute_by_kind"]
        implied = r["published_step_ms"] - fsdp["exposed_comm_ms"] - fsdp["optimizer_ms"]
        lines.append(f"| {r['row']} | {r['published_step_ms']:.0f} | {fsdp['step_ms']:.0f} | {fsdp['compute_ms']:.0f} "
                     f"| {kinds['matmul']:.0f} | {kinds['attention']:.0f} | {kinds['memory-bound']:.0f} "
                     f"| {implied:.0f} | {error(fsdp['compute_ms'], implied)} | {fsdp['comm_ms']:.0f} "
                     f"| {fsdp['exposed_comm_ms']:.0f} | {fsdp['optimizer_ms']:.0f} |")
    lines += ["", "The predicted peak by kind (GiB; per algorithm, at the step's largest phase; live = the kinds' "
              "sum, allocated = in 512-byte blocks, packed = in segments packed perfectly (a lower bound), "
              "reserved = the segments the simulated allocator holds, the prediction):", "",
              "| row | algorithm | phase | " + " | ".join(header for _, header in KIND_HEADERS)
              + " | live | allocated | packed | reserved | published |",
              "|---|---|---|" + "---:|" * (len(KIND_HEADERS) + 5)]
    for r in rows:
        for algo in ("fsdp", "overlap-plan"):
            figures = r["run"][algo]
            parts = " | ".join(gib(figures["peak_parts"][kind]) for kind, _ in KIND_HEADERS)
            lines.append(f"| {r['row']} | {algo} | {figures['peak_phase']} | {parts} | {gib(figures['live_bytes'])} "
                         f"| {gib(figures['allocated_bytes'])} | {gib(figures['packed_bytes'])} "
                         f"| {gib(figures['peak_bytes'])} "
                         f"| {r['published_memory_gib']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, help="a kept capture (--keep) to plan again instead of capturing")
    parser.add_argument("--keep", type=Path, help="keep the captured bundle here")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    import dcsched

    with tempfile.TemporaryDirectory() as tmp:
        path = args.bundle
        if path is None:
            path = args.keep or Path(tmp) / "llama8b.pt"
            seconds = capture(32, path)
            print(f"captured 32 layers in {seconds:.0f} s (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
        rows = evaluate(under_the_runs_policy(dcsched.load(path)))
    print(json.dumps(rows, indent=1) if args.json else render(rows))


if __name__ == "__main__":
    main()
