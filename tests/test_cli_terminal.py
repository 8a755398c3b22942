"""Strings from a bundle or a path are shown as text: no rich markup, no terminal control (issue 12)."""

from __future__ import annotations

import re

import pytest

import dcsched
from bundles import linear_bundle
from dcsched.cli import run
from dcsched.cli.app import safe_text

HOSTILE_NAMES = ["[/]unbalanced", "[red]EVIL[/red]", "bell\x07[bold]x"]
CLEAR_SCREEN = "measured\x1b[2J\x1b[31m"


@pytest.fixture
def wide_console():
    """Render as on a 200-column terminal, so no name is wrapped across lines."""
    from dcsched.cli.app import console, err_console
    saved = console._width, err_console._width
    console.width = err_console.width = 200
    yield
    console._width, err_console._width = saved


def hostile_bundle(name: str):
    bundle = linear_bundle()
    bundle.params[0] = dcsched.ParamInfo(name, (4, 4), bundle.params[0].dtype, 0)
    bundle.provenance["device"] = CLEAR_SCREEN
    bundle.provenance[name] = name
    return bundle


@pytest.mark.parametrize("name", HOSTILE_NAMES)
@pytest.mark.parametrize("command", [["show"], ["schedule", "--algo", "none", "--params"],
                                     ["replay", "--iters", "1", "--warmup", "0", "--device", "cpu"]])
def test_bundle_strings_are_printed_as_text(tmp_path, capsys, wide_console, name, command):
    path = dcsched.save(hostile_bundle(name), tmp_path / "in[red]x.pt")
    code = run([command[0], str(path), *command[1:]])
    out, err = capsys.readouterr()
    assert code == 0, err
    shown = out + err
    assert "\x1b" not in shown and "\x07" not in shown, "a control character reached the terminal"
    squashed = re.sub(r"[\s│┃]", "", shown)
    assert "in[red]x." in squashed, shown
    if command[0] != "replay":
        assert re.sub(r"\s", "", name.replace("\x07", "\\x07")) in squashed, shown
    if command[0] == "show":
        assert "measured\\x1b[2J\\x1b[31m" in shown


@pytest.mark.parametrize("text,shown", [
    ("[/]unbalanced", "[/]unbalanced"), ("[red]EVIL[/red]", "[red]EVIL[/red]"), ("a\x1b[2Jb", "a\\x1b[2Jb"),
    ("tab\there", "tab\\there"), ("rtl\u202eevil", "rtl\\u202eevil"), ("plain name", "plain name"),
])
def test_safe_text_renders_literally(text, shown):
    from rich.console import Console
    console = Console(record=True, width=200, color_system=None)
    console.print(safe_text(text), highlight=False)
    assert console.export_text().rstrip("\n") == shown
