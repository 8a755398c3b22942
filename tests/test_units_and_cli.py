"""Size parsing, the `show` command, `python -m dcsched` and help texts."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import dcsched
from dcsched.cli import run
from dcsched.errors import DcschedError
from dcsched.budget import Budget
from dcsched.errors import OptionError
from dcsched.units import format_bytes, format_ms, parse_size

from bundles import linear_bundle


@pytest.mark.parametrize("text,expected", [
    ("512", 512), ("1kB", 1000), ("1KiB", 1024), ("6GiB", 6 * 2**30), ("1.5GB", 1_500_000_000),
    ("800 MiB", 800 * 2**20), ("2e3", 2000), ("1TB", 10**12), ("3g", 3 * 10**9),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "1.2.3GB", "5 parsecs", "-1GB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_formats():
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(12) == "12 B"
    assert format_ms(1500) == "1.500 s"
    assert format_ms(2.5) == "2.500 ms"


def test_show_json(tmp_path, capsys):
    path = dcsched.save(linear_bundle(2), tmp_path / "g.pt")
    assert run(["show", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    forward = summary["graphs"]["forward"]
    assert forward["roles"]["allgather"] == 2 and forward["roles"]["release"] == 2
    assert forward["comm_ms"] == pytest.approx(2.0)
    assert summary["param_bytes"] == 2 * 64
    assert summary["provenance"]["device_time"] == "hand-written"


def test_show_table(tmp_path, capsys):
    path = dcsched.save(linear_bundle(2), tmp_path / "g.pt")
    assert run(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "layers.1.weight" in out and "forward" in out and "hand-written" in out


def test_python_dash_m_matches_script(tmp_path):
    path = dcsched.save(linear_bundle(1), tmp_path / "g.pt")
    result = subprocess.run([sys.executable, "-m", "dcsched", "show", str(path), "--json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["graphs"]["forward"]["roles"]["allgather"] == 1
    bad = subprocess.run([sys.executable, "-m", "dcsched", "show", str(tmp_path / "missing.pt")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no such file" in bad.stderr and "Traceback" not in bad.stderr


def test_help_lists_commands(capsys):
    assert run(["--help"]) == 0
    assert "show" in capsys.readouterr().out


@pytest.mark.parametrize("value,expected", [
    ("unlimited", math.inf), ("Infinite", math.inf), (" inf ", math.inf), ("none", math.inf), (math.inf, math.inf),
    ("800MB", 800_000_000), (2**30, 2**30), (1.5e9, 1_500_000_000), ("0", 0), (1e30, int(1e30)),
    ("2e6TiB", 2 * 10**6 * 2**40),
])
def test_parse_budget(value, expected):
    assert Budget.parse(value).bytes == expected


@pytest.mark.parametrize("value", ["1e400GB", "nan", math.nan, -1, "-1GB", True, [1], -math.inf])
def test_parse_budget_rejects_with_one_error(value):
    with pytest.raises(OptionError, match="^memory_budget is ") as info:
        Budget.parse(value)
    assert info.value.option == "memory_budget" and isinstance(info.value, DcschedError)


@pytest.mark.parametrize("text,words", [("1e400GB", "not a size"), ("nan", "not a size"), ("inf", "not a size"),
                                        ("2e6TiB", "a typo?")])
def test_parse_size_rejects_non_finite_and_absurd(text, words):
    with pytest.raises(ValueError, match=words):
        parse_size(text)


@pytest.mark.parametrize("args,words", [
    (["replay", "x.pt", "--iters", "0"], "Invalid value for '--iters'"),
    (["schedule", "x.pt", "--bogus"], "No such option: --bogus"),
    (["show"], "Missing argument"),
    (["nosuch"], "No such command 'nosuch'"),
    (["replay", "x.pt", "--warmup", "many"], "Invalid value for '--warmup'"),
])
def test_usage_errors_are_one_line_exit_2(capsys, args, words):
    assert run(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("dcsched: error: ") and words in err and "--help" in err, err


def test_no_arguments_still_prints_the_help(capsys):
    assert run([]) == 2
    out, err = capsys.readouterr()
    assert "Usage" in out + err and "dcsched: error" not in err


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["replay", "x.pt", "--iters", "0"], ["schedule", "--help"],
                                  ["train", "--help"]])
def test_cli_answers_without_importing_torch(args):
    code = ("import sys\nfrom dcsched.cli import run\ncode = run(sys.argv[1:])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(code)")
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode in (0, 2) and "torch was imported" not in result.stderr, result.stderr


def test_python_api_names_resolve_lazily():
    code = ("import sys, dcsched\nassert 'torch' not in sys.modules\nimport dcsched.sim.simulate\n"
            "assert callable(dcsched.simulate) and dcsched.simulate.__module__ == 'dcsched.sim.simulate'\n"
            "assert dcsched.load.__module__ == 'dcsched.bundle.core' and 'load' in dir(dcsched)\n"
            "from dcsched import capture, Bundle\nassert callable(capture)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
