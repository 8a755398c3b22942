"""The report-format registry (dcsched.report.formats): names, laziness, the contract, and what the built-ins write."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

import dcsched
from bundles import linear_bundle
from dcsched.report import formats
from dcsched.cli import run
from dcsched.errors import DcschedError
from dcsched.report.compare import compare_bundle
from dcsched.report.sweep import sweep_bundle
from dcsched.report.chrome_trace import chrome_trace

BUILTIN = ["table", "json", "trace", "plot", "sweep"]


@pytest.fixture(scope="module")
def report():
    bundle = linear_bundle(3)
    comparison = compare_bundle(bundle, ["none", "fast-free"])
    return formats.ScheduleReport(Path("in.pt"), comparison, outputs={"none": Path("in.none.pt")},
                                  param_names={p.ds_id: p.name for p in bundle.params})


def test_builtins_are_listed_and_loaded_only_when_asked_for():
    code = ("import sys\nfrom dcsched.report import formats\nnames = formats.available()\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('dcsched.report.formats.'))\n"
            "print(names, loaded, 'torch' in sys.modules)\n"
            "formats.get('table')\nprint('dcsched.report.formats.table' in sys.modules, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    assert first == f"{BUILTIN} ['dcsched.report.formats.model', 'dcsched.report.formats.registry'] False"
    assert second == "True False"  # the table format itself does not need torch either


@pytest.mark.parametrize("name,to_file,reports", [
    ("table", False, ("schedule",)), ("json", False, ("schedule", "sweep")), ("trace", True, ("schedule",)),
    ("plot", True, ("schedule", "sweep")), ("sweep", False, ("sweep",)),
])
def test_builtin_contract(name, to_file, reports):
    fmt = formats.get(name)
    assert (fmt.name, fmt.to_file, fmt.reports) == (name, to_file, reports)
    assert fmt.description and callable(fmt.write)
    assert (fmt.check is not None) == (name == "plot")


def test_unknown_and_twice_registered():
    with pytest.raises(DcschedError, match=r"unknown report format 'bmp' \(available: table, json, trace, plot, sweep"):
        formats.get("bmp")
    with pytest.raises(ValueError, match="registered twice"):
        formats.register("table", description="again")(lambda report, console: None)


def test_a_new_format_is_one_registration(report):
    @formats.register("algorithms-demo", description="test only", reports=("schedule",))
    def write(rep, console):
        console.print(", ".join(rep.comparison.algorithms), highlight=False)

    try:
        assert "algorithms-demo" in formats.available()
        console = Console(record=True, width=80, color_system=None)
        formats.get("algorithms-demo")(report, console)
        assert console.export_text() == "none, fast-free\n"
        sweep = formats.SweepReport(Path("in.pt"), "all", {})
        with pytest.raises(DcschedError, match="does not render a sweep report"):
            formats.get("algorithms-demo")(sweep, console)
    finally:
        formats.unregister("algorithms-demo")
    assert "algorithms-demo" not in formats.available()


def test_json_is_the_comparison_with_input_outputs_and_files(report, capsys):
    report.files = {"trace": Path("t.json")}
    try:
        formats.get("json")(report, Console())
    finally:
        report.files = {}
    document = json.loads(capsys.readouterr().out)
    assert document == json.loads(json.dumps(report.comparison.to_dict(
        input="in.pt", outputs={"none": "in.none.pt"}, trace="t.json")))
    assert list(document)[:4] == ["version", "input", "outputs", "trace"]


def test_trace_writes_the_chrome_trace_of_every_order(report, tmp_path):
    path = tmp_path / "t.json"
    formats.get("trace")(report, path)
    runs = [(f"{name} / {label}", result) for name, cmp in report.comparison.graphs.items()
            for label, result in [("before", cmp.before), *cmp.after.items()]]
    assert json.loads(path.read_text()) == json.loads(json.dumps(chrome_trace(runs)))


def test_table_and_sweep_print_every_graph(report):
    console = Console(record=True, width=200, color_system=None)
    formats.get("table")(report, console)
    text = console.export_text()
    assert text.count("nodes,") == len(report.comparison.graphs) and "fast-free" in text
    assert text.rstrip().endswith("wrote in.none.pt (none)")
    curves = sweep_bundle(linear_bundle(3), scope="all")
    console = Console(record=True, width=200, color_system=None)
    formats.get("sweep")(formats.SweepReport(Path("in.pt"), "all", curves), console)
    text = console.export_text()
    assert "forward: overlap at growing memory budgets (all scope)" in text and "unlimited" in text


def test_a_file_format_the_sweep_cannot_write_is_refused_before_any_work(tmp_path, capsys):
    path = dcsched.save(linear_bundle(3), tmp_path / "g.pt")
    assert run(["schedule", str(path), "--algo", "overlap", "--sweep", "--trace", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the trace format does not render a sweep report" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.pt"]


# ---------------------------------------------------------------------------
# The table at 80 and 160 columns: the orders as rows, one line each
# ---------------------------------------------------------------------------

METRICS = ("peak memory", "at node", "gathered peak", "step time", "exposed comm", "overlap", "scheduler time")


@pytest.fixture(scope="module")
def every_algorithm():
    from dcsched.budget import Budget
    from dcsched.schedulers import available
    bundle = linear_bundle(4)
    algorithms = available()
    return formats.ScheduleReport(Path("in.pt"), compare_bundle(bundle, algorithms, budget=Budget.unlimited()))


def rendered(report, width):
    console = Console(record=True, width=width, color_system=None)
    formats.get("table")(report, console)
    return console.export_text()


def table_rows(text):
    return [line for line in text.splitlines() if line.startswith("│")]


@pytest.mark.parametrize("width", [80, 160])
def test_every_order_one_line_per_table_at_narrow_widths(every_algorithm, width):
    text = rendered(every_algorithm, width)
    assert all(len(line) <= width for line in text.splitlines()), text
    rows = table_rows(text)
    assert rows and not [r for r in rows if not r[1:].split("│")[0].strip()], "a cell wrapped onto a second line"
    orders = ["before", *every_algorithm.comparison.algorithms]
    firsts = [r[1:].split("│")[0].strip() for r in rows]
    tables = firsts.count("before")
    assert tables >= 1 and all(firsts.count(order) == tables for order in orders), firsts
    assert all(metric in text for metric in METRICS)
    assert "ag:primals_" in text and "allgather_ds_param_primals" not in text
    # (each prefix shortened is named; a bucket's peak sits at its first wait, the copy-out)
    note = " ".join(text.split())
    assert "node names shortened (" in note and "ag: allgather_ds_param_" in note and "full names with --json" in note
    if width == 160:
        # every figure in at most two tables (a bucket's peak at its first wait names a longer node)
        assert tables <= 2


def test_wide_terminal_keeps_algorithms_as_columns(every_algorithm):
    text = rendered(every_algorithm, 400)
    assert "┃ figure " in text and "allgather_ds_param_primals" in text and "shortened" not in text


def test_cli_80_columns_rows_and_json_full_names(tmp_path, capsys):
    from dcsched.cli.app import console
    path = dcsched.save(linear_bundle(4), tmp_path / "g.pt")
    saved = console._width
    console.width = 80
    try:
        assert run(["schedule", str(path), "--algo", "all", "--memory-budget", "unlimited"]) == 0
        out = capsys.readouterr().out
        assert run(["schedule", str(path), "--algo", "all", "--memory-budget", "unlimited", "--json",
                    "--force"]) == 0
        document = json.loads(capsys.readouterr().out)
    finally:
        console._width = saved
    assert "ag:primals_" in out and all(len(line) <= 80 for line in out.splitlines())
    nodes = {figures["gathered_peak_node"] for figures in document["graphs"]["forward"]["after"].values()}
    # a bucket's gathered peak is at its first wait (the copy-out), every other's at an all-gather
    assert nodes and all(node.startswith(("allgather_ds_param_primals_", "wait_allgather_ds_param__primals_"))
                         for node in nodes)
