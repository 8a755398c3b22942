"""The package is clean under its linter (ruff) and type checker (mypy), configured in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("tool", ["ruff", "mypy"])
def test_the_package_is_clean(tool):
    result = _run("ruff", "check", "dcsched") if tool == "ruff" else _run("mypy", "dcsched")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
