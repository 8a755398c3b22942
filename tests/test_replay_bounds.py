"""Replay bounded by the bundle's own figures: lies about sizes or times refused before anything is
allocated or run, a step past its time bound stopped with one line (exit code 2)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.fx

import dcsched
from dcsched.bundle.core import Bundle, InputInfo
from dcsched.cli import run
from dcsched.errors import DcschedError
from dcsched.replay import bounds
from dcsched.replay.watchdog import Watchdog

ROOT = Path(__file__).resolve().parent.parent
aten = torch.ops.aten


def _bundle(build, inputs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> Bundle:
    """A forward-only bundle: ``build(graph, placeholders)`` adds nodes and returns the loss node."""
    graph = torch.fx.Graph()
    placeholders = [graph.placeholder(f"x_{k}") for k in range(len(inputs))]
    for node, (_name, shape, dtype) in zip(placeholders, inputs):
        node.meta.update(out={"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")})
    graph.output((build(graph, placeholders),))
    return Bundle(forward=graph, backward=None, params=[],
                  inputs=[InputInfo(name, shape, dtype, low=0, high=1) for name, shape, dtype in inputs],
                  forward_placeholders=[{"kind": "input", "index": k} for k in range(len(inputs))],
                  backward_placeholders=[], provenance={"device_time": "hand-written"})


def _call(graph, target, args, name, *, time_ms=0.1, out=None, size=None):
    node = graph.create_node("call_function", target, tuple(args), {}, name=name)
    node.meta["device_time"] = time_ms
    if out is not None:
        node.meta["out"] = {"shape": list(out[0]), "dtype": out[1]}
    if size is not None:
        node.meta["tensor_size"] = size
    return node


def _full(out=None, size=64):
    """``aten.full`` of 3 GiB (24576 x 32768 float32), its figures saying ``size`` bytes."""
    def build(graph, xs):
        full = _call(graph, aten.full.default, ([24576, 32768], 1.0), "full", out=out, size=size)
        return _call(graph, aten.sum.default, (full,), "total", out=((), "float32"), size=4)
    return _bundle(build, [("x", (2,), torch.float32)])


def _chain(n: int, side: int, time_ms: float):
    """``n`` chained ``side`` x ``side`` matrix products, each recorded as taking ``time_ms``."""
    def build(graph, xs):
        h = xs[0]
        for k in range(n):
            h = _call(graph, aten.mm.default, (h, xs[0]), f"mm_{k}", time_ms=time_ms, out=((side, side), "float32"),
                      size=side * side * 4)
        return _call(graph, aten.sum.default, (h,), "total", out=((), "float32"), size=4)
    return _bundle(build, [("x", (side, side), torch.float32)])


def _one_line(capsys, code: int, *words: str) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    flat = " ".join(err.split())
    for word in words:
        assert word in flat, err
    return flat


def _cli(args: list[str], timeout: float = 120, setup: str = "") -> tuple[int, str, int, float]:
    """``dcsched`` in a fresh process: (exit code, stderr, peak RSS in bytes, seconds)."""
    code = ("import resource, sys\n" + setup + "\nfrom dcsched.cli import run\ncode = run(sys.argv[1:])\n"
            "sys.stdout.write('maxrss=%d' % (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))\n"
            "sys.stdout.flush()\nsys.exit(code)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)
    seconds = time.monotonic() - start
    rss = int(done.stdout.rsplit("maxrss=", 1)[1]) if "maxrss=" in done.stdout else -1
    return done.returncode, done.stderr.strip(), rss, seconds


def test_a_3_gib_full_recorded_as_64_bytes_is_refused_before_allocating(tmp_path):
    path = dcsched.save(_full(), tmp_path / "full.pt")
    code, err, rss, _seconds = _cli(["replay", str(path), "--device", "cpu"])
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "node full outputs float32[24576, 32768] (3.00 GiB) when run" in err and "tensor_size 64 B" in err, err
    assert 0 < rss < 2 * 2**30, f"peak RSS {rss} bytes: the 3 GiB tensor was allocated"
    assert os.listdir(tmp_path) == ["full.pt"]


@pytest.mark.parametrize("out,words", [
    (((4, 4), "float32"), "the bundle records float32[4, 4] (64 B)"),
    (((24576, 32768), "float16"), "the bundle records float16[24576, 32768] (1.50 GiB)"),
])
def test_a_shape_or_dtype_lie_is_refused_naming_the_node_and_both(tmp_path, capsys, out, words):
    path = dcsched.save(_full(out=out, size=None), tmp_path / "lie.pt")
    _one_line(capsys, run(["replay", str(path), "--device", "cpu"]), "node full outputs float32[24576, 32768]",
              words, "refused before running")


def test_chained_8192_products_recorded_at_a_tenth_of_a_ms_are_refused_before_running(tmp_path, capsys):
    path = dcsched.save(_chain(4, 8192, 0.1), tmp_path / "chain.pt")
    start = time.monotonic()
    flat = _one_line(capsys, run(["replay", str(path), "--device", "cpu"]), "node mm_0 computes 1.1e+12 FLOPs",
                     "records 100.0 us")
    assert time.monotonic() - start < 30, flat


#: 100 products of 2048 x 2048 (17 GFLOP each, 1.7 TFLOP in all: 60 s on CI's two cores, several seconds even on
#: a CPU ten times as fast), each recorded as 0.2 ms: the step's figures say 20.1 ms with the final sum.
SLOW_CHAIN = (100, 2048, 0.2)


def test_timeout_stops_a_replay_with_one_line(tmp_path):
    path = dcsched.save(_chain(*SLOW_CHAIN), tmp_path / "slow.pt")
    code, err, _rss, seconds = _cli(["replay", str(path), "--device", "cpu", "--iters", "1", "--warmup", "0",
                                     "--timeout", "2"])
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "replay stopped: the replay ran past its bound of 2 s (--timeout 2)" in err
    assert seconds < 60


def test_a_step_past_its_figures_bound_is_stopped(tmp_path):
    path = dcsched.save(_chain(*SLOW_CHAIN), tmp_path / "slow.pt")
    setup = "import dcsched.replay.bounds as b; b.TIME_FLOOR_S = 1.0; b.TIME_FACTOR = 100"
    code, err, _rss, seconds = _cli(["replay", str(path), "--device", "cpu", "--iters", "1", "--warmup", "0"],
                                    setup=setup)
    assert code == 2 and len(err.splitlines()) == 1, err
    # 100 x 0.2 ms and the sum's 0.1 ms, times 100: 2.01 s
    assert "the first step ran past its bound of 2.01 s (a step may take 100 x the bundle's 20.1 ms of recorded " \
        "device time, at least 1 s; --timeout SECONDS sets another bound)" in err
    assert seconds < 60


def test_honest_figures_replay_and_their_bounds():
    bundle = _chain(2, 16, 0.01)
    step = bounds.check_step(bundle, "cpu", dcsched.runtime.ops.Zero3Runtime())
    assert step.flops == 2 * 2 * 16 ** 3
    assert step.resident_bytes == 16 * 16 * 4 and step.peak_bytes >= step.resident_bytes
    assert step.step_seconds() == bounds.TIME_FLOOR_S
    run_ = dcsched.replay.replay(bundle, iters=1)
    assert set(run_.results) == {"loss"}


def test_memory_past_the_free_memory_is_refused():
    step = bounds.StepBounds(peak_bytes=2**30, resident_bytes=2**20, recorded_ms=1.0, flops=0.0)
    assert bounds.check_memory([step], torch.device("cpu"), available=2 * 2**30) == int(1.5 * 2**30)
    with pytest.raises(DcschedError, match=r"needs up to 1\.50 GiB .* x 1\.5\) but only 1\.00 GiB is free"):
        bounds.check_memory([step], torch.device("cpu"), available=2**30)
    with pytest.raises(DcschedError, match="the other order's parameters and inputs 1.00 MiB"):
        bounds.check_memory([step, step], torch.device("cpu"), available=int(1.5 * 2**30) + 1)


def test_watchdog_stops_past_its_memory_limit():
    stops: list[str] = []
    with Watchdog(memory_limit=64 * 2**20, on_stop=stops.append, poll_s=0.01):
        block = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched
        deadline = time.monotonic() + 5
        while not stops and time.monotonic() < deadline:
            time.sleep(0.01)
        del block
    assert stops and "past its bound of 64.00 MiB" in stops[0], stops

