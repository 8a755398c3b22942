"""``dcsched train`` over 2 gloo ranks: torchrun on the GPT example (algorithms agree), a killed and a raising rank."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gloo import GLOO_MARKS
from train_runs import free_port

pytestmark = GLOO_MARKS

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "64", "--seq", "8", "--batch", "2",
        "--steps", "3", "--lr", "1e-2"]
ANALYTIC = ["--cost-model", "analytic", "--gpu", "h100", "--no-progress"]
ALGOS = ("none", "fast-free", "overlap")


def _env(**extra) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    return env


def torchrun() -> list[str]:
    found = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture(scope="module")
def gpt_runs():
    """The GPT example under ``torchrun --nproc-per-node 2`` once per algorithm, the three launched together.

    The user's default settings: the measured cost model, each rank timing its own nodes.
    """
    procs = {}
    for algo in ALGOS:
        cmd = [*torchrun(), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "dcsched", "train",
               str(ROOT / "examples" / "gpt.py"), "--algo", algo, "--no-progress", "--json", "--timeout", "60",
               "--", *TINY]
        procs[algo] = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
    results = {}
    for algo, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results[algo] = json.loads(out)
    return results


def test_torchrun_losses_bit_identical_across_algorithms(gpt_runs):
    losses = {algo: run["losses"] for algo, run in gpt_runs.items()}
    assert len(losses["none"]) == 3
    assert losses["none"] == losses["fast-free"] == losses["overlap"], losses
    for run in gpt_runs.values():
        assert run["world_size"] == 2 and [g["graph"] for g in run["graphs"]] == ["forward", "backward"]
        for graph in run["graphs"]:  # per-rank peak (CPU tracker) beside the simulator's at world size 2
            assert abs(graph["measured_peak_bytes"] - graph["simulated_peak_bytes"]) <= \
                0.05 * graph["simulated_peak_bytes"], graph


FAILING = """
    import os, signal, sys, time, torch
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = torch.compile(model)
    for step in range(50):
        out = model(torch.ones(2, 4))
        if step == 2 and os.environ["RANK"] == "1" and sys.argv[1] == "loop":
            while True:   # its main thread stuck (its heartbeat thread beats on)
                pass
        if step == 2 and os.environ["RANK"] == "1" and sys.argv[1] != "loop-after":
            if sys.argv[1] in ("kill", "term"):
                os.kill(os.getpid(), signal.SIGKILL if sys.argv[1] == "kill" else signal.SIGTERM)
                time.sleep(60)  # SIGTERM: the watch posts it and exits at once
            raise ValueError("rank 1 gave up")
        out.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    if os.environ["RANK"] == "1" and sys.argv[1] == "loop-after":
        while True:   # stuck after its last step: rank 0 must not wait for it forever
            pass
"""
TIMEOUT_S = 3.0
#: How rank 1 fails: killed, raising, sent SIGTERM, its main thread looping mid-run and after its last step.
MODES = ("kill", "raise", "term", "loop", "loop-after")
#: The SIGTERM run's timeout: long, so a peer named sooner was told, not timed out.
TERM_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def failing_runs(tmp_path_factory):
    """Two ranks (launched as torchrun would, without its agent) of a script whose rank 1 dies or raises.

    Returns, per mode, each rank's (exit code, stderr, time of exit).
    """
    script = tmp_path_factory.mktemp("failing") / "failing.py"
    script.write_text(textwrap.dedent(FAILING))
    launched = {}
    for mode in MODES:
        port = free_port()
        timeout = TERM_TIMEOUT_S if mode == "term" else TIMEOUT_S
        launched[mode] = [subprocess.Popen(
            [sys.executable, "-m", "dcsched", "train", str(script), *ANALYTIC, "--timeout", str(timeout), "--",
             mode], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port))) for rank in (0, 1)]
    ended: dict[tuple[str, int], float] = {}
    deadline = time.monotonic() + 300
    while len(ended) < 2 * len(MODES) and time.monotonic() < deadline:
        for mode, procs in launched.items():
            for rank, proc in enumerate(procs):
                if (mode, rank) not in ended and proc.poll() is not None:
                    ended[(mode, rank)] = time.monotonic()
        time.sleep(0.05)
    results = {}
    for mode, procs in launched.items():
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        results[mode] = [(proc.returncode, proc.communicate()[1], ended.get((mode, rank)))
                         for rank, proc in enumerate(procs)]
    return results


def test_a_killed_rank_is_named_within_the_timeout(failing_runs):
    (code0, err0, end0), (code1, _err1, end1) = failing_runs["kill"]
    assert code1 == -signal.SIGKILL
    assert code0 == 1, err0
    lines = err0.strip().splitlines()
    assert lines == [f"dcsched train: rank 1 failed: no heartbeat for {TIMEOUT_S:.1f} s"], err0
    # Detected after the timeout (counted from the last beat seen, up to one 0.75 s interval before the kill),
    # plus a few intervals and the load of a busy machine.
    assert end0 - end1 <= TIMEOUT_S + 6, end0 - end1


def test_a_rank_sent_sigterm_posts_it_and_is_named_at_once(failing_runs):
    (code0, err0, end0), (code1, err1, end1) = failing_runs["term"]
    assert code1 == 128 + signal.SIGTERM and err1.strip().splitlines()[-1].startswith(
        "dcsched train: rank 1 terminated by SIGTERM (torchrun stops every worker once one fails"), err1
    assert code0 == 1 and err0.strip().splitlines() == ["dcsched train: rank 1 failed: terminated by SIGTERM"], err0
    assert end0 - end1 <= 10 < TERM_TIMEOUT_S, end0 - end1  # a few heartbeats, not the timeout


def test_a_raising_rank_is_named(failing_runs):
    (code0, err0, _), (code1, err1, _) = failing_runs["raise"]
    lines = err0.strip().splitlines()
    assert code0 == 1 and len(lines) == 1, err0
    assert lines[0].startswith("dcsched train: rank 1 failed: raised: ValueError: rank 1 gave up (") and \
        "failing.py:" in lines[0], err0
    assert code1 == 1 and "ValueError: rank 1 gave up" in err1.strip().splitlines()[-1], err1


@pytest.mark.parametrize("mode, words", [
    ("loop", "rank 1 failed: no progress for "),
    ("loop-after", "rank 1 failed: no progress for "),
])
def test_a_rank_whose_main_thread_is_stuck_is_named(failing_runs, mode, words):
    # Its heartbeat thread still beats: the watch reads that its count of collectives stopped while rank 0
    # waited in a later one (or had finished), and names rank 1, not rank 0's timed-out collective.
    (code0, err0, end0), (code1, _err1, _end1) = failing_runs[mode]
    assert code0 == 1 and end0 is not None, err0
    lines = err0.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dcsched train: {words}"), err0
    assert ("after rank 0 finished" in lines[0]) == (mode == "loop-after"), err0
