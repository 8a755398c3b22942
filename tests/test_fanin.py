"""Wide fan-ins (one node reading many gathered parameters, a long release chain): every scheduler returns
a valid order, fast-free DeepSpeed's; the free-cost sums its ties are broken by are Python's.

Speed is measured in benchmarks/bench_fanin.py, not asserted here.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dcsched.graph.form import GraphForm
from dcsched.graph.nxview import to_networkx
from dcsched.schedulers import available, run
from dcsched.schedulers.fast_free.free_costs import FOLDS_ARE_SEQUENTIAL, skip_one_folds
from dcsched.schedulers.overlap_plan.head_pieces import HEAD_UNITS, head_pieces
from dcsched.synthetic.fanin import fanin_graph
from scheduling import scheduled

import oracle  # tests/oracle.py: the literal, slow statements of the rules

FAST_FREE_ORACLE = oracle.output_last_of(oracle.fast_free_oracle)


def assert_valid(form: GraphForm, order) -> None:
    assert sorted(order) == sorted(form.names)
    form.check_order(list(order))  # topological: every input before its reader


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_every_scheduler_orders_a_wide_fan_in(kind):
    form = GraphForm(fanin_graph(300, kind=kind))
    assert max(len(p) for p in form.preds) >= 300
    for algo in available():
        assert_valid(form, run(algo, form).order)


def test_fan_in_family_shape():
    graph = fanin_graph(50, groups=2)
    cats = [n for n in graph.nodes if n.op == "call_function" and "cat" in str(n.target)]
    assert [len(c.args[0]) for c in cats] == [25, 26]  # the second also reads the first's result
    assert len(graph.nodes) == 4 * 50 + 4
    with pytest.raises(ValueError):
        fanin_graph(3, groups=4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_params=st.integers(1, 40), groups=st.integers(1, 4), seed=st.integers(0, 10_000),
       kind=st.sampled_from(["forward", "backward"]), distinct=st.booleans(), tie_prone=st.booleans())
def test_fan_ins_and_release_chains(n_params, groups, seed, kind, distinct, tie_prone):
    graph = fanin_graph(n_params, kind=kind, seed=seed, groups=min(groups, n_params), distinct_sizes=distinct,
                        tie_prone=tie_prone)
    form = GraphForm(graph)
    for algo in available():
        assert_valid(form, run(algo, form).order)
    view = to_networkx(graph)
    assert scheduled("fast-free", view) == FAST_FREE_ORACLE(view)


@pytest.mark.skipif(not FOLDS_ARE_SEQUENTIAL, reason="Python's sum compensates from 3.12")
@given(st.lists(st.sampled_from([0.0, 0.004096, 0.016384, 0.065536, 0.25, 1e-17, 3e16, 0.1, 0.7]), min_size=1,
                max_size=120), st.data())
def test_skip_one_folds_are_pythons_sums(times, data):
    skipped = sorted(data.draw(st.sets(st.integers(0, len(times) - 1), min_size=1)))
    folds = skip_one_folds(np.array(times), np.array(skipped))
    assert [float(f) for f in folds] == [sum([t for i, t in enumerate(times) if i != s]) for s in skipped]


def test_skip_one_folds_refuse_negative_terms():
    assert skip_one_folds(np.array([1.0, -1.0]), np.array([0])) is None


def test_a_long_head_is_cut_in_runs():
    form = GraphForm(fanin_graph(3 * HEAD_UNITS))
    gathers = [i for i in form.topo if form.kind[i] == 2]
    cuts = head_pieces(form, form.topo, gathers, 4, latency_ms=0.02)
    for count, pieces in cuts.items():
        assert len(pieces) == count
        assert sorted(m for piece in pieces for m in piece) == sorted(gathers)


def fan_in_bundle(n_params: int):
    import torch

    from dcsched.bundle.core import Bundle, InputInfo, ParamInfo

    return Bundle(forward=fanin_graph(n_params), backward=None,
                  params=[ParamInfo(f"experts.{i}.weight", (64, 64), torch.float32, i) for i in range(n_params)],
                  inputs=[InputInfo("x", (4,), torch.float32)],
                  forward_placeholders=[{"kind": "param", "ds_id": i} for i in range(n_params)]
                  + [{"kind": "input", "index": 0}],
                  backward_placeholders=[], provenance={"device_time": "synthetic", "tensor_size": "synthetic"})


def test_schedule_json_stays_clean_with_progress(tmp_path, capsys):
    import json

    import dcsched
    from dcsched.cli import run as cli

    path = dcsched.save(fan_in_bundle(40), tmp_path / "fanin.pt")
    assert cli(["schedule", str(path), "--algo", "fast-free,overlap", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["algorithms"] == ["fast-free", "overlap"]
    assert "scheduling 40 all-gathers" in err


def test_ticker_shows_the_running_step_on_a_terminal(monkeypatch):
    import io

    from rich.console import Console

    import dcsched.cli.schedule as schedule_cli

    stream = io.StringIO()
    monkeypatch.setattr(schedule_cli, "err_console", Console(file=stream, force_terminal=True, width=100))
    with schedule_cli._Ticker() as tick:
        assert tick.display is not None
        tick("forward: scheduling 3 all-gathers of 9 nodes with fast-free")
    assert "scheduling 3 all-gathers" in stream.getvalue()
    monkeypatch.setattr(schedule_cli, "err_console", Console(file=io.StringIO(), force_terminal=False))
    with schedule_cli._Ticker() as tick:
        assert tick.display is None  # not a terminal: the plain lines only
