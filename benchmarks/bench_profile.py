"""Plan large training steps without their weights: ``dcsched profile --meta`` on model configurations.

For each model (built from a ``transformers`` config in a generated script, bf16, no weights) this runs, in a
fresh process each, ``dcsched profile SCRIPT --meta --cost-model analytic --gpu h100 --world-size W`` and then
``dcsched schedule BUNDLE --algo all``, and prints a table: parameters, graph nodes, profile seconds and peak
RSS, schedule seconds and peak RSS. Targets (issue 30): profile under 3 minutes and 4 GiB on a 2-core, 24 GiB
machine.

    python benchmarks/bench_profile.py                      # every model
    python benchmarks/bench_profile.py --models llama-7b --layers 4   # fewer layers, a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

#: name -> (transformers class, config class, config keyword arguments, world size planned for)
MODELS = {
    "llama-7b": ("LlamaForCausalLM", "LlamaConfig",
                 dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000), 64),
    "llama-70b": ("LlamaForCausalLM", "LlamaConfig",
                  dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=128256), 512),
    "mixtral-8x7b": ("MixtralForCausalLM", "MixtralConfig",
                     dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2), 64),
    "deepseek-moe-64": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                        dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                             num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                             n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
                             vocab_size=102400, n_group=1, topk_group=1), 64),
}

SCRIPT = """
    import torch
    import transformers
    config = transformers.{config}(**{kwargs!r}, max_position_embeddings={seq}, use_cache=False)
    model = transformers.{model}(config).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters())
    compiled = torch.compile(model)
    ids = torch.randint(0, config.vocab_size, ({batch}, {seq}))
    compiled(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
"""


def timed(command: list[str]) -> tuple[float, float, str]:
    """(seconds, peak RSS GiB of the child, its stdout on one line) of ``command`` in a fresh process."""
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "RSS_KB %M", *command], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    rss = re.findall(r"RSS_KB (\d+)", done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("RSS_KB")]
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} failed: {lines[-1] if lines else done.returncode}")
    return seconds, (int(rss[-1]) / 2**20 if rss else float("nan")), " ".join(done.stdout.split())


def measure(name: str, layers: int | None, seq: int, batch: int, directory: Path) -> dict:
    model, config, kwargs, world = MODELS[name]
    if layers is not None:
        kwargs = {**kwargs, "num_hidden_layers": layers}
    script = directory / f"{name}.py"
    script.write_text(textwrap.dedent(SCRIPT.format(model=model, config=config, kwargs=kwargs, seq=seq, batch=batch)))
    bundle = directory / f"{name}.pt"
    dcsched = [sys.executable, "-m", "dcsched"]
    profile_s, profile_gib, said = timed([*dcsched, "profile", str(script), "-o", str(bundle), "--meta", "--force",
                                          "--cost-model", "analytic", "--gpu", "h100", "--world-size", str(world),
                                          "--no-progress"])
    schedule_s, schedule_gib, _ = timed([*dcsched, "schedule", str(bundle), "--algo", "all", "--force", "--json",
                                         "-o", str(directory / f"{name}.scheduled.pt")])
    params = re.search(r"(\d+) parameters \(([^)]*)\)", said)
    nodes = re.findall(r"(forward|backward) (\d+) nodes", said)
    return {"model": name, "layers": kwargs["num_hidden_layers"], "world_size": world,
            "parameter_bytes": params.group(2) if params else "?", "nodes": {k: int(v) for k, v in nodes},
            "profile_s": round(profile_s, 1), "profile_rss_gib": round(profile_gib, 2),
            "schedule_all_s": round(schedule_s, 1), "schedule_rss_gib": round(schedule_gib, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--layers", type=int, default=None, help="override every model's layer count")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            try:
                rows.append(measure(name, args.layers, args.seq, args.batch, Path(tmp)))
            except RuntimeError as error:
                rows.append({"model": name, "error": str(error)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"load average {os.getloadavg()[0]:.1f}; seq {args.seq}, batch {args.batch}")
    print("| model | layers | W | parameters | fwd nodes | bwd nodes | profile s | profile GiB | schedule all s "
          "| schedule GiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        if "error" in row:
            print(f"| {row['model']} | failed: {row['error']} |")
            continue
        print(f"| {row['model']} | {row['layers']} | {row['world_size']} | {row['parameter_bytes']} "
              f"| {row['nodes'].get('forward', '')} | {row['nodes'].get('backward', '')} | {row['profile_s']} "
              f"| {row['profile_rss_gib']} | {row['schedule_all_s']} | {row['schedule_rss_gib']} |")


if __name__ == "__main__":
    main()
