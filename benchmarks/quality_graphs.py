"""Graphs for ``bench_quality.py``: captured stacks of several architectures, cached under ``benchmarks/.cache/``.

Capturing runs the model once on the CPU (2 cores in CI take minutes for the
deep stacks), so each bundle is captured and profiled once with the analytic
H100 cost model and kept in ``benchmarks/.cache/<arch>-<layers>.pt``
(gitignored). Run this module alone to fill the cache::

    .venv/bin/python benchmarks/quality_graphs.py            # every configuration
    .venv/bin/python benchmarks/quality_graphs.py gpt-8      # one
    .venv/bin/python benchmarks/quality_graphs.py convnet_down-8 convnet_down-32 convnet_down-80
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dcsched  # noqa: E402
from dcsched.costmodels.options import ProfileOptions  # noqa: E402
from dcsched.profile.measure import profile_bundle  # noqa: E402

CACHE = ROOT / "benchmarks" / ".cache"
SAMPLES = ROOT / "sample_graphs"

#: Model sizes: a token batch of 2,048 and width 512 keep a layer's compute and its
#: all-gathers within a factor of ~2 of each other with :data:`PROFILE`'s cost model
#: (H100 roofline, 8 ranks at 100 GB/s, 20 us latency), which is where overlap matters most.
CONFIGS = {
    "gpt": dict(d_model=512, n_heads=8, vocab=8192, seq=512, batch=4),
    "llama": dict(d_model=512, n_heads=8, vocab=8192, seq=512, batch=4),
    "convnet": dict(width=64, image=64, batch=32),
    # Mixtral-style: Llama with 8 SwiGLU experts per layer, each token routed to 2 (models.MoE).
    "mixtral": dict(d_model=512, n_heads=8, vocab=8192, seq=512, batch=4, n_experts=8, top_k=2),
    # ViT-Base/16's geometry (224 x 224 images, 16 x 16 patches: 197 tokens, 1,000 classes) at the
    # others' width (512, 8 heads, MLP 2,048), batch 8 (1,576 tokens).
    "vit": dict(d_model=512, n_heads=8, image=224, patch=16, n_classes=1000, batch=8),
}
#: Stress configurations, benchmarked with ``--stress`` only: ``convnet_down`` downsamples in every
#: block (so deep stacks run hundreds of 512-channel 3x3 convolutions at 1x1 resolution, whose
#: all-gathers dwarf their compute): not a network anyone trains, but the hardest case for a budget.
STRESS = {
    "convnet_down": dict(model="convnet", width=64, image=64, batch=32, stages="n_layers"),
}
LAYERS = (8, 32, 80)
#: Depths per architecture where not all of LAYERS (an 80-layer Mixtral is 5.6 GB of float32
#: parameters, too much to capture on a 24 GiB machine beside its gradients).
DEPTHS = {"mixtral": (8, 32), "vit": (12, 48)}


def depths(arch: str) -> tuple[int, ...]:
    return DEPTHS.get(arch, LAYERS)
#: 100 GB/s and 20 us, given: the figures the results in docs/overlap.md were made with (the interconnect
#: table's H100 NVLink figures are faster).
PROFILE = ProfileOptions(cost_model="analytic", gpu="h100", latency_us=20.0, bandwidth_gbps=100.0, progress=False)


def cache_path(arch: str, n_layers: int) -> Path:
    return CACHE / f"{arch}-{n_layers}.pt"


def captured(arch: str, n_layers: int, *, build_missing: bool = True) -> dcsched.Bundle | None:
    """The profiled bundle of ``arch`` with ``n_layers`` layers, from the cache or captured now."""
    path = cache_path(arch, n_layers)
    if path.exists():
        return dcsched.load(path)
    if not build_missing:
        return None
    from dcsched.profile.capture import capture
    from dcsched.examples import build

    CACHE.mkdir(parents=True, exist_ok=True)
    ignore = CACHE / ".gitignore"
    if not ignore.exists():
        ignore.write_text("*\n")
    started = time.perf_counter()
    config = dict(CONFIGS.get(arch) or STRESS[arch])
    model_name = config.pop("model", arch)
    if config.get("stages") == "n_layers":
        config["stages"] = n_layers
    model, inputs, loss_fn = build(model_name, n_layers=n_layers, **config)
    bundle = profile_bundle(capture(model, inputs, loss_fn), PROFILE)
    dcsched.save(bundle, path)
    print(f"captured {arch}-{n_layers} in {time.perf_counter() - started:.0f} s -> {path}", file=sys.stderr)
    return bundle


def samples() -> dict[str, dcsched.Bundle]:
    """The sample bundles shipped in ``sample_graphs/``."""
    return {f"sample:{p.stem}": dcsched.load(p) for p in sorted(SAMPLES.glob("*.pt"))}


def main(argv: list[str]) -> None:
    wanted = argv or [f"{a}-{n}" for a in CONFIGS for n in depths(a)]
    for item in wanted:
        arch, _, n = item.partition("-")
        captured(arch, int(n))


if __name__ == "__main__":
    main(sys.argv[1:])
