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

import peer_table  # noqa: E402
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
        for key in ("cpu_ms", "peak_mib"):
            assert len(row[key]) == 2 and all(value > 0 for value in row[key]), (key, row[key])
        assert row["step_ms"] > 0 and row["first_step_s"] > 0
        # the step is the maximum over the ranks, so at least each rank's own median
        assert row["step_ms"] >= min(row["rank_step_ms"]) and row["round_step_ms"] == [row["step_ms"]]
        assert row["collectives"] > 0
        # the first step, the profiled one, 2 timed ones; on both ranks
        assert row["steps_compared"] == 2 * 4 and all(len(losses) == 4 for losses in row["losses"])
        assert row["loss_diff_vs_ddp"] <= 1e-4
    assert rows["ddp"]["loss_diff_vs_ddp"] == 0 and rows["ddp"]["vs_ddp"] == 1.0
    assert rows["dcsched-none"]["vs_ddp"] == round(rows["dcsched-none"]["step_ms"] / rows["ddp"]["step_ms"], 2)
    assert rows["dcsched-none"]["vs_best_zero3"] is None  # no ZeRO-3 peer ran
    assert rows["dcsched-none"]["dcsched_collectives"] == rows["dcsched-none"]["collectives"]
    assert rows["dcsched-none"]["losses"][0] != rows["dcsched-none"]["losses"][1]  # each rank its own batches
    assert rows["dcsched-none"]["losses"][0][-1] != rows["dcsched-none"]["losses"][0][0]  # it trained


def test_configurations_and_the_table():
    args = train_peers.arguments(["--config", "fsdp2", "--algo", "fsdp", "--compute", "eager",
                                  "--compute", "inductor"])
    assert args.configs == ["fsdp2", "ddp"]  # DDP is the losses' reference, always trained
    default = train_peers.arguments([]).configs
    assert default[:3] == ["dcsched-overlap-plan", "dcsched-overlap-plan-inductor", "dcsched-fsdp"]
    assert default[3:] == list(train_peers.PEERS)
    assert {"fsdp2-prefetch", "fsdp2-compile-block", "simplefsdp"} <= set(default)
    everything = train_peers.arguments(["--algo", "prefetch-ahead", "--compute", "inductor"]).configs
    assert everything[:4] == [*default[:3], "dcsched-prefetch-ahead-inductor"]
    # the known algorithms under either compute without --algo; another algorithm with it
    assert train_peers.arguments(["--config", "dcsched-none-inductor"]).configs == ["dcsched-none-inductor", "ddp"]
    with pytest.raises(SystemExit):
        train_peers.arguments(["--config", "dcsched-prefetch-ahead"])
    with pytest.raises(SystemExit):
        train_peers.arguments(["--batch", "7"])  # does not split over 2 ranks
    rows = [{"config": "ddp", "model": "gpt", "step_ms": 1.25, "cpu_ms": [1.0, 1.0], "peak_mib": [3.0, 3.0],
             "collectives": 3, "first_step_s": 0.5, "loss_diff_vs_ddp": 0.0},
            {"config": "deepspeed-zero3", "model": "gpt", "error": "not importable"}]
    text = train_peers.table(rows).splitlines()
    assert text[0].split()[:2] == ["config", "model"]
    assert "1.0/1.0" in text[1] and text[2].endswith("not importable")


def test_every_round_shuffles_the_configurations_the_same_way_on_every_rank():
    names = ["dcsched-overlap-plan", "fsdp2", "fsdp2-prefetch", "simplefsdp", "ddp"]
    orders = [peer_table.round_order(names, round_) for round_ in range(5)]
    assert all(sorted(order) == sorted(names) for order in orders)
    assert orders == [peer_table.round_order(list(names), round_) for round_ in range(5)]  # every rank's
    assert len({tuple(order) for order in orders}) > 1  # not one fixed order
    assert peer_table.round_order(names, 0, seed=1) != orders[0] or peer_table.round_order(names, 1, seed=1) != \
        orders[1]


def test_the_step_is_the_slowest_rank_per_step_and_the_ratios_compare_like_with_like():
    # round 1: steps' maxima 12, 11, 13 -> 12; round 2: 9, 9.5, 30 -> 9.5; median of the rounds 10.75
    rank0 = [[12.0, 10.0, 13.0], [9.0, 9.0, 9.0]]
    rank1 = [[11.0, 11.0, 10.0], [8.0, 9.5, 30.0]]
    assert peer_table.step_over_ranks([rank0, rank1]) == (10.75, [12.0, 9.5])
    figures = {"ddp": 100.0, "fsdp2": 150.0, "fsdp2-prefetch": 120.0, "deepspeed-zero3": 90.0,
               "fsdp2-compile": 140.0, "simplefsdp": 110.0, "dcsched-overlap-plan": 108.0,
               "dcsched-overlap-plan-inductor": 99.0}
    rows = [{"config": name, "model": "gpt", "step_ms": ms} for name, ms in figures.items()]
    rows.append({"config": "fsdp2-compile-block", "model": "gpt", "error": "no"})
    rows.append({"config": "fsdp2", "model": "llama", "step_ms": 1.0})  # another model's rows are not compared
    by_name = {row["config"]: row for row in peer_table.add_ratios(rows) if row["model"] == "gpt"}
    assert by_name["dcsched-overlap-plan"]["best_zero3"] == "deepspeed-zero3"  # eager against eager
    assert by_name["dcsched-overlap-plan"]["vs_best_zero3"] == 1.2 and by_name["dcsched-overlap-plan"]["vs_ddp"] == 1.08
    assert by_name["dcsched-overlap-plan-inductor"]["best_zero3"] == "simplefsdp"  # compiled against compiled
    assert by_name["dcsched-overlap-plan-inductor"]["vs_best_zero3"] == 0.9
    assert "vs_best_zero3" not in by_name["fsdp2"] and by_name["fsdp2"]["vs_ddp"] == 1.5
    assert "vs_ddp" not in by_name["fsdp2-compile-block"]
    cells = peer_table.table(list(by_name.values()))
    assert "0.9 (simplefsdp)" in cells and "1.2 (deepspeed-zero3)" in cells


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
    rank = {"ddp": {"losses": [1.0], "step_ms": [[2.0]], "cpu_ms": [[2.0]], "collectives": 4, "asynchronous": None,
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
    rank = {"ddp": {"losses": [1.0], "step_ms": [[2.0]], "cpu_ms": [[2.0]], "collectives": 4, "asynchronous": None,
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
