"""``benchmarks/bench_train.py --peers``: dcsched against DDP (and FSDP2, DeepSpeed) on 2 gloo ranks.

The spawned run is the benchmark's own command on a tiny GPT, 1 round of 2 timed steps, dcsched ``none`` and DDP
only: every row has its figures and dcsched's losses are DDP's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gloo import GLOO_MARKS

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import train_peers  # noqa: E402

TINY = ["--set", "n_layers=1", "--set", "d_model=32", "--set", "n_heads=2", "--set", "vocab=64", "--set", "seq=8"]


def _gloo(test):
    for mark in GLOO_MARKS:
        test = mark(test)
    return test


@_gloo
def test_peers_mode_trains_dcsched_and_ddp_to_the_same_losses():
    command = [sys.executable, str(BENCHMARKS / "bench_train.py"), "--peers", "--model", "gpt",
               "--config", "dcsched-none", "--config", "ddp", "--runs", "1", "--steps", "2", "--warmup", "0",
               "--json", *TINY]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCHMARKS.parent),
                                                                      os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["config"]: row for row in json.loads(done.stdout)}
    assert set(rows) == {"dcsched-none", "ddp"}
    for row in rows.values():
        assert "error" not in row, row
        for key in ("step_ms", "cpu_ms", "peak_mib", "first_step_s"):
            assert len(row[key]) == 2 and all(value > 0 for value in row[key]), (key, row[key])
        assert row["collectives"] > 0
        # the first step, the profiled one, 2 timed ones; on both ranks
        assert row["steps_compared"] == 2 * 4 and all(len(losses) == 4 for losses in row["losses"])
        assert row["loss_diff_vs_ddp"] <= 1e-4
    assert rows["ddp"]["loss_diff_vs_ddp"] == 0
    assert rows["dcsched-none"]["dcsched_collectives"] == rows["dcsched-none"]["collectives"]
    assert rows["dcsched-none"]["losses"][0] != rows["dcsched-none"]["losses"][1]  # each rank its own batches
    assert rows["dcsched-none"]["losses"][0][-1] != rows["dcsched-none"]["losses"][0][0]  # it trained


def test_configurations_and_the_table():
    args = train_peers.arguments(["--config", "fsdp2", "--algo", "fsdp", "--compute", "eager",
                                  "--compute", "inductor"])
    assert args.configs == ["fsdp2", "ddp"]  # DDP is the losses' reference, always trained
    everything = train_peers.arguments(["--algo", "fsdp", "--compute", "inductor"]).configs
    assert everything[:5] == ["dcsched-none-inductor", "dcsched-fast-free-inductor", "dcsched-overlap-inductor",
                              "dcsched-overlap-plan-inductor", "dcsched-fsdp-inductor"]
    assert everything[5:] == list(train_peers.PEERS)
    with pytest.raises(SystemExit):
        train_peers.arguments(["--config", "dcsched-fsdp"])  # not without --algo fsdp
    with pytest.raises(SystemExit):
        train_peers.arguments(["--batch", "7"])  # does not split over 2 ranks
    rows = [{"config": "ddp", "model": "gpt", "step_ms": [1.25, 2.0], "cpu_ms": [1.0, 1.0], "peak_mib": [3.0, 3.0],
             "collectives": 3, "first_step_s": [0.5, 0.5], "loss_diff_vs_ddp": 0.0},
            {"config": "deepspeed-zero3", "model": "gpt", "error": "not importable"}]
    text = train_peers.table(rows).splitlines()
    assert text[0].split()[:2] == ["config", "model"]
    assert "1.25/2.0" in text[1] and text[2].endswith("not importable")


def test_deepspeed_that_is_not_installed_is_a_row_not_a_failure(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    assert train_peers._deepspeed_missing().startswith("not importable")


def test_checkpointing_forms_are_checked_and_label_the_rows():
    args = train_peers.arguments(["--model", "llama", "--checkpointing", "none,full,selective,full"])
    assert args.forms == ["none", "full", "selective"] and args.form == "none"
    assert train_peers.arguments([]).forms == ["none"]  # the default: no checkpointing, unlabelled rows
    with pytest.raises(SystemExit):
        train_peers.arguments(["--model", "llama", "--checkpointing", "everything"])
    with pytest.raises(SystemExit):
        train_peers.arguments(["--model", "gpt", "--checkpointing", "full"])  # the GPT checkpoints nothing
    assert train_peers.arguments(["--model", "hf-llama", "--checkpointing", "none,full,reentrant"]).forms == \
        ["none", "full", "reentrant"]  # gradient_checkpointing_enable, non-reentrant and reentrant
    with pytest.raises(SystemExit):
        train_peers.arguments(["--model", "hf-llama", "--checkpointing", "selective"])
    args = train_peers.arguments(["--model", "llama", "--checkpointing", "none,full"])
    args.form = "full"
    rank = {"ddp": {"losses": [1.0], "step_ms": [2.0], "cpu_ms": [2.0], "collectives": 4, "asynchronous": None,
                    "collectives_by_kind": {}, "dcsched_collectives": None}}
    args.configs = ["ddp"]
    row, = train_peers.rows_for("llama", [rank, rank], args, load=1.0)
    assert row["checkpointing"] == "full" and row["model"].endswith("ckpt full")


def test_the_mixed_precision_recipe_is_fsdp2s_policy_for_both_and_labels_the_rows():
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import dcsched
    from peer_recipes import mixed_precision
    assert mixed_precision("none", fsdp2=True) == {} and mixed_precision("none", fsdp2=False) is None
    ours, theirs = mixed_precision("bf16", fsdp2=False), mixed_precision("bf16", fsdp2=True)["mp_policy"]
    assert isinstance(ours, dcsched.MixedPrecisionPolicy) and isinstance(theirs, MixedPrecisionPolicy)
    for policy in (ours, theirs):
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    args = train_peers.arguments(["--mp-policy", "bf16", "--config", "ddp"])
    assert args.mp_policy == "bf16"
    rank = {"ddp": {"losses": [1.0], "step_ms": [2.0], "cpu_ms": [2.0], "collectives": 4, "asynchronous": None,
                    "collectives_by_kind": {}, "dcsched_collectives": None}}
    row, = train_peers.rows_for("gpt", [rank, rank], args, load=1.0)
    assert row["mp_policy"] == "bf16" and row["model"].endswith("mp bf16")
    with pytest.raises(SystemExit):
        train_peers.arguments(["--mp-policy", "fp8"])


@pytest.mark.slow
@_gloo
def test_peers_mode_trains_the_hugging_face_llama_checkpointed_as_ddp_does():
    pytest.importorskip("transformers")
    command = [sys.executable, str(BENCHMARKS / "bench_train.py"), "--peers", "--model", "hf-llama",
               "--checkpointing", "full", "--algo", "fsdp", "--config", "dcsched-fsdp", "--config", "fsdp2",
               "--runs", "1", "--steps", "1", "--warmup", "0", "--json", *TINY]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCHMARKS.parent),
                                                                      os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["config"]: row for row in json.loads(done.stdout)}
    assert set(rows) == {"dcsched-fsdp", "fsdp2", "ddp"}
    for row in rows.values():
        assert "error" not in row, row
        assert row["model"].startswith("hf-llama 1x32") and row["checkpointing"] == "full"
        assert row["loss_diff_vs_ddp"] <= 1e-4 and row["steps_compared"] == 2 * 3
    assert rows["dcsched-fsdp"]["dcsched_collectives"] == rows["dcsched-fsdp"]["collectives"]
