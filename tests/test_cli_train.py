"""``dcsched train`` in one process: the GPT example trains as eager does, algorithms agree, reports, bad input."""

from __future__ import annotations

import contextlib
import io
import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from dcsched.cli import run
from dcsched.profile.scripts import run_script

GPT = Path(__file__).resolve().parent.parent / "examples" / "gpt.py"
#: A tiny GPT: a step takes milliseconds.
TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "64", "--seq", "8", "--batch", "2",
        "--steps", "4", "--lr", "1e-2"]
ANALYTIC = ["--cost-model", "analytic", "--gpu", "h100"]


def train_json(capsys, *options: str, script: Path = GPT, args=TINY) -> dict:
    code = run(["train", str(script), *options, *ANALYTIC, "--json", "--no-progress", "--", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def eager_losses(script: Path, args) -> list[float]:
    """The script run with torch.compile left out (the model runs eagerly); its losses as the module returns them."""
    losses = []

    class Recording(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *inputs):
            loss = self.inner(*inputs)
            losses.append(float(loss.detach()))
            return loss

    run_script(script, args, lambda model=None, **kwargs: Recording(model))
    return losses


@pytest.fixture(scope="module")
def runs():
    """``none`` as JSON, ``fast-free`` as JSON, ``overlap`` with --report: each run once for the module."""
    results = {}
    for algo, flag in (("none", "--json"), ("fast-free", "--json"), ("overlap", "--report")):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run(["train", str(GPT), "--algo", algo, *ANALYTIC, flag, "--no-progress", "--", *TINY])
        results[algo] = (code, out.getvalue(), err.getvalue())
    return results


def test_gpt_trains_as_eager_does(runs):
    code, out, err = runs["none"]
    assert code == 0, err
    report = json.loads(out)
    eager = eager_losses(GPT, TINY)
    assert len(report["losses"]) == len(eager) == 4
    for ours, theirs in zip(report["losses"], eager):
        assert math.isclose(ours, theirs, rel_tol=1e-5), (report["losses"], eager)
    assert "step 3: loss" in err  # the script's own output, moved to stderr under --json


def test_algorithms_give_bit_identical_losses(runs):
    losses = {algo: json.loads(runs[algo][1])["losses"] for algo in ("none", "fast-free")}
    overlap_out = runs["overlap"][1]
    assert losses["none"] == losses["fast-free"]
    last = losses["none"][-1]
    assert f"last {last:.6g}" in overlap_out


def test_json_holds_measured_and_simulated_figures(runs):
    report = json.loads(runs["fast-free"][1])
    assert report["algo"] == "fast-free" and report["world_size"] == 1 and report["modules"] == ["GPT"]
    assert [g["graph"] for g in report["graphs"]] == ["forward", "backward"]
    for g in report["graphs"]:
        assert g["steps"] == 4 and g["timed_steps"] == 3 and g["measured_ms"] > 0 and g["simulated_ms"] > 0
        # The CPU tracker and the simulator count the same tensors (docs/train.md: within 5%).
        assert abs(g["measured_peak_bytes"] - g["simulated_peak_bytes"]) <= 0.1 * g["simulated_peak_bytes"]
    assert "analytic" in report["caveat"]
    saved = report["activation_memory"]["GPT"]  # the example GPT checkpoints nothing
    assert saved["saved_bytes"] > 0 and saved["without_checkpointing_bytes"] is None and saved["reduction"] is None
    memory = report["step_memory"]["GPT"]  # the whole step: the script's AdamW found, its states counted
    parts = memory["parts"]
    assert memory["optimizer"] == "adamw" and sum(parts.values()) == memory["peak_bytes"]
    assert parts["optimizer_states"] >= 2 * parts["parameter_shards"] > 0  # two moments a shard (+ step scalars)
    assert memory["peak_bytes"] >= max(g["simulated_peak_bytes"] for g in report["graphs"])
    assert memory["peak_bytes"] == memory["phases"][memory["phase"]]


def test_report_is_a_table_per_graph(runs):
    code, out, err = runs["overlap"]
    assert code == 0, err
    assert "dcsched train" in out and "algo overlap" in out
    assert "GPT forward" in out and "GPT backward" in out and "KiB" in out
    assert "step 0: loss" in out  # the script prints as usual
    assert "Whole-step memory per rank" in out and "optimizer states" in out and "optimizer: adamw" in out
    assert "GPT: activation memory saved for backward:" in out and "(no checkpointing: no saving)" in " ".join(
        out.split())


def test_compute_inductor_trains_as_eager_does_and_reports_times_alone(capsys, runs):
    report = train_json(capsys, "--algo", "overlap", "--compute", "inductor")
    assert report["compute"] == "inductor"
    eager_compute = json.loads(runs["none"][1])["losses"]
    for ours, theirs in zip(report["losses"], eager_compute, strict=True):
        assert math.isclose(ours, theirs, rel_tol=1e-5), (report["losses"], eager_compute)
    for g in report["graphs"]:
        # The first step compiles and is not timed; inductor's buffers are not tracked.
        assert g["timed_steps"] == 3 and g["measured_ms"] > 0 and g["measured_peak_bytes"] is None


def write(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


LINEAR = """
    import sys, torch
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
"""


@pytest.mark.parametrize("case, body, code, words", [
    ("no-compile", LINEAR + "model(torch.randn(2, 4)).sum().backward(); optimizer.step()\n", 2,
     "never calls torch.compile"),
    ("stepped-before", LINEAR.replace("SGD(model.parameters(), lr=0.1)", "AdamW(model.parameters())")
     + "model(torch.randn(2, 4)).sum().backward(); optimizer.step()\nmodel = torch.compile(model)\n"
     + "model(torch.randn(2, 4)).sum().backward(); optimizer.step()\n", 2, "stepped before torch.compile"),
    ("raises", LINEAR + "model = torch.compile(model)\nraise ValueError('boom')\n", 1, "ValueError: boom"),
    ("exits", LINEAR + "sys.exit(3)\n", 3, None),
])
def test_script_errors(tmp_path, capsys, case, body, code, words):
    script = write(tmp_path, f"{case}.py", body.replace("\n    ", "\n"))
    assert run(["train", str(script), "--no-progress"]) == code
    out, err = capsys.readouterr()
    if words is not None:
        assert err.startswith("dcsched: error: ") and words in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_a_compiled_linear_model_trains(tmp_path, capsys):
    script = write(tmp_path, "linear.py", LINEAR.replace("\n    ", "\n") + textwrap.dedent("""
        model = torch.compile(model)
        for _ in range(3):
            loss = model(torch.ones(2, 4)).sum()
            loss.backward(); optimizer.step(); optimizer.zero_grad()
    """))
    report = train_json(capsys, "--algo", "list", script=script, args=[])
    assert "losses" not in report  # the module returns no loss: the script computes it
    assert [(g["graph"], g["steps"]) for g in report["graphs"]] == [("forward", 3), ("backward", 3)]


@pytest.mark.parametrize("options, words", [
    (["--algo", "nosuch"], "nosuch"),
    (["--algo", "overlap", "--memory-budget", "lots"], "--memory-budget is not a size"),
    (["--algo", "fast-free", "--memory-budget", "1GiB"], "takes no memory budget"),
    (["--budget-scope", "some", "--algo", "overlap"], "budget scope"),
    (["--timeout", "0"], "--timeout"),
    (["--timeout", "inf"], "--timeout must be between 0.1 and 604800 seconds"),
    (["--timeout", "1e20"], "--timeout must be between 0.1 and 604800 seconds"),
    (["--timeout", "0.000001"], "--timeout must be between 0.1 and 604800 seconds"),
    (["--timeout", "nan"], "--timeout must be between"),
    (["--compute", "fast"], "unknown compute 'fast'"),
    (["--replicate-below", "-1"], "--replicate-below must be a whole number of elements, 0 or more, not -1"),
    (["--cost-model", "analytic"], "--gpu is missing"),
    (["--algo", "none", "-O", "k=2"], "--option has 'k', which scheduler 'none' does not take (taken by: "
                                      "prefetch-ahead)"),
    (["--algo", "prefetch-ahead", "--option", "k"], "expected KEY=VALUE"),
    (["--algo", "overlap", "-O", "memory_budget=lots"], "--memory-budget is not a size"),
    (["--algo", "overlap", "--memory-budget", "1GiB", "-O", "memory_budget=2GiB"], "--memory-budget given twice"),
])
def test_invalid_options_exit_2_before_running(tmp_path, capsys, options, words):
    marker = tmp_path / "ran"
    script = write(tmp_path, "touch.py", f"open({str(marker)!r}, 'w').close()\n")
    assert run(["train", str(script), *options]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("dcsched: error: ") and words in err and len(err.strip().splitlines()) == 1, err
    assert not marker.exists()


def test_scheduler_options_reach_the_scheduler(tmp_path, capsys, monkeypatch):
    # -O KEY=VALUE, parsed as dcsched schedule parses it, reaches the scheduler of every compiled graph.
    import dcsched.train.backend as train_backend
    calls = []
    real = train_backend.run_step

    def recording(scheduler, forms, **options):  # the registry entry resolved once, by TrainOptions
        calls.append((scheduler.name, sorted(forms), {k: v for k, v in options.items() if k != "comm_latency_ms"}))
        return real(scheduler, forms, **options)

    monkeypatch.setattr(train_backend, "run_step", recording)
    script = write(tmp_path, "linear.py", LINEAR.replace("\n    ", "\n") + textwrap.dedent("""
        model = torch.compile(model)
        loss = model(torch.ones(2, 4)).sum()
        loss.backward(); optimizer.step()
    """))
    report = train_json(capsys, "--algo", "prefetch-ahead", "-O", "k=2", script=script, args=[])
    assert report["algo"] == "prefetch-ahead"
    assert calls == [("prefetch-ahead", ["backward", "forward"], {"budget": None, "k": 2})]  # the step at once


def test_missing_script(tmp_path, capsys):
    assert run(["train", str(tmp_path / "nope.py")]) == 2
    assert "no such script" in capsys.readouterr().err


def test_compiles_show_a_transient_progress_display_on_a_terminal(monkeypatch, capsys):
    from rich.console import Console
    import dcsched.cli.train as cli_train
    terminal = io.StringIO()
    monkeypatch.setattr(cli_train, "err_console", Console(file=terminal, force_terminal=True, width=120))
    monkeypatch.setattr(cli_train, "PROGRESS_DELAY_S", 0.0)  # every compile takes longer than no time
    assert run(["train", str(GPT), "--algo", "overlap", "--compute", "inductor", *ANALYTIC, "--", *TINY]) == 0
    shown = terminal.getvalue()
    assert "compiling GPT (1): capture, profile, schedule (overlap)" in shown
    assert "compiling GPT's forward graph with inductor" in shown
    assert "compiling GPT's backward graph with inductor" in shown
    assert "step 3: loss" in capsys.readouterr().out  # the script's output is its own


def test_the_gpt_example_saves_and_resumes_under_dcsched_train(capsys, tmp_path):
    # examples/gpt.py --save / --resume (dcsched.save_checkpoint / load_checkpoint) in a sharded run: the
    # resumed steps equal the uninterrupted run's bit for bit, under another algorithm.
    checkpoint = str(tmp_path / "ckpt")
    whole = train_json(capsys, "--algo", "fast-free", args=[*TINY, "--steps", "8"])["losses"]
    first = train_json(capsys, "--algo", "fast-free", args=[*TINY, "--steps", "4", "--save", checkpoint])["losses"]
    rest = train_json(capsys, "--algo", "overlap", args=[*TINY, "--steps", "8", "--resume", checkpoint])["losses"]
    assert len(whole) == 8 and first == whole[:4] and rest == whole[4:]
