"""The budget read once at the edge (``dcsched.budget``), the Plan result, and the one entry ``schedulers.run``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch.fx

import dcsched
from dcsched import schedulers
from dcsched.budget import Budget, budget_for, check_scope, default_budget, device_memory
from dcsched.cli.app import in_flags
from dcsched.errors import BudgetError, DcschedError, OptionError, ScheduleError
from dcsched.graph.form import GraphForm
from dcsched.graph.nxview import to_networkx
from dcsched.schedulers import Bucket, Plan, run
from dcsched.schedulers.deepcompile import DeepCompile
from dcsched.schedulers.overlap.scheduler import Overlap
from dcsched.synthetic import layered_stack, random_graph
from dcsched.report.options import ScheduleOptions
from dcsched.train.options import TrainOptions


def _bundle(target=None) -> dcsched.Bundle:
    bundle = dcsched.Bundle(forward=torch.fx.Graph(), backward=None, params=[], inputs=[],
                            forward_placeholders=[], backward_placeholders=[])
    if target is not None:
        bundle.provenance["target_memory_bytes"] = target
    return bundle


# -- Budget -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    ("40GiB", 40 * 2**30), ("1.5GB", 1_500_000_000), (2**30, 2**30), (1.5e9, 1_500_000_000), ("0", 0),
    ("unlimited", math.inf), ("INF", math.inf), (math.inf, math.inf), (None, math.inf),
])
def test_parse_gives_bytes(value, expected):
    budget = Budget.parse(value)
    assert budget.bytes == expected and budget.scope == "all"
    assert budget.is_unlimited == (expected == math.inf)


@pytest.mark.parametrize("value", ["-5", "lots", "1e400GB", "nan", math.nan, -1, True, [1], -math.inf])
def test_unreadable_budget_is_an_option_error_naming_the_parameter(value):
    with pytest.raises(OptionError) as info:
        Budget.parse(value)
    assert info.value.option == "memory_budget" and str(info.value).startswith("memory_budget is ")
    assert "--" not in str(info.value)


def test_scope():
    assert Budget.parse("1GiB", scope="gathered") == Budget(2**30, "gathered")
    assert Budget.parse(Budget(10), scope="gathered") == Budget(10, "gathered")
    assert Budget.parse(Budget(10, "gathered")) == Budget(10, "gathered")
    assert check_scope("all") == "all"
    with pytest.raises(OptionError, match="^budget_scope names an unknown budget scope 'some'"):
        Budget.parse("1GiB", scope="some")
    with pytest.raises(OptionError):
        Budget(10, "activations")


def test_budget_is_frozen_and_json():
    budget = Budget(100)
    with pytest.raises(dataclasses.FrozenInstanceError):
        budget.bytes = 5
    assert budget.to_dict() == {"bytes": 100, "scope": "all"}
    assert Budget.unlimited("gathered").to_dict() == {"bytes": None, "scope": "gathered"}


def test_one_default_rule():
    # The device's memory less 10% where one is recorded, else no limit: for bundles, dicts, graphs and forms.
    assert default_budget(_bundle(80 * 10**9)) == Budget(72 * 10**9)
    assert default_budget(_bundle(80 * 10**9), scope="gathered") == Budget(72 * 10**9, "gathered")
    assert default_budget(_bundle(80 * 10**9), margin=10**9).bytes == 79 * 10**9
    for source in (_bundle(), None, {}, layered_stack(1).forward, GraphForm(layered_stack(1).forward)):
        assert default_budget(source) == Budget.unlimited()
    assert device_memory({"target_memory_bytes": 5}) == 5 and device_memory(_bundle()) is None
    with pytest.raises(OptionError, match="margin"):
        default_budget(_bundle(1000), margin=-0.5)
    with pytest.raises(OptionError, match="leaves no memory"):
        default_budget(_bundle(1000), margin=2000)
    # budget_for: the value given wins; none given, the default rule.
    assert budget_for("1GiB", _bundle(80 * 10**9)) == Budget(2**30)
    assert budget_for(None, _bundle(1000)) == Budget(900)
    assert budget_for(None, _bundle()) == Budget.unlimited()


def test_train_uses_the_same_rule():
    assert TrainOptions(algo="overlap").budget(_bundle(1000)) == Budget(900)
    assert TrainOptions(algo="overlap").budget(_bundle()) == Budget.unlimited()
    assert TrainOptions(algo="overlap", memory_budget="40GiB", budget_scope="gathered").budget(_bundle(1000)) == \
        Budget(40 * 2**30, "gathered")
    assert TrainOptions(algo="fast-free").budget(_bundle(1000)) is None
    with pytest.raises(OptionError, match="memory_budget"):
        TrainOptions(algo="overlap", memory_budget="lots").check()


def test_train_budget_fsdp_is_fsdps_own_peak_and_a_step_planners_default_where_no_device_is_known():
    from dcsched import replay
    from dcsched.collective_issue import FSDP2, FSDP2_ON_GLOO, GLOO, PROCESS_GROUP
    from dcsched.schedulers.fsdp.peak import fsdp_peak
    from dcsched.sim.collectives import latency_from_provenance

    bundle = replay.example_bundle()  # profiled on the CPU: no device's memory recorded
    assert device_memory(bundle) is None
    forms = {name: bundle.form(name) for name in bundle.graph_names}
    latency = latency_from_provenance(bundle.provenance)
    for issue, fsdp_issue in ((PROCESS_GROUP, FSDP2), (GLOO, FSDP2_ON_GLOO)):  # FSDP2's way on the run's backend
        peak = fsdp_peak(forms, comm_latency_ms=latency, issue=fsdp_issue)
        for given in ("fsdp", " FSDP", None):  # named, or overlap-plan's default
            assert TrainOptions(algo="overlap-plan", memory_budget=given).budget(bundle, issue=issue) == \
                Budget(peak)
        assert TrainOptions(algo="overlap-plan", memory_budget="fsdp", budget_scope="gathered").budget(
            bundle, issue=issue) == Budget(fsdp_peak(forms, comm_latency_ms=latency, issue=fsdp_issue,
                                                     scope="gathered"), "gathered")
    # not a step planner: no limit where no device is known; a device's memory recorded: the one default rule
    assert TrainOptions(algo="overlap").budget(bundle) == Budget.unlimited()
    assert TrainOptions(algo="overlap-plan").budget(_with_device(bundle, 1000)) == Budget(900)
    TrainOptions(algo="overlap", memory_budget="fsdp").check()
    with pytest.raises(OptionError, match="takes no memory budget"):
        TrainOptions(algo="fast-free", memory_budget="fsdp").check()
    with pytest.raises(OptionError, match="is a training budget"):  # dcsched schedule --memory-budget fsdp
        Budget.parse("fsdp")


def _with_device(bundle, target: int):
    import dataclasses
    return dataclasses.replace(bundle, provenance={**bundle.provenance, "target_memory_bytes": target})


# -- errors ---------------------------------------------------------------------------------------------

def test_budget_too_small_is_a_budget_error_in_python_words_and_flag_words_on_the_cli():
    graph = layered_stack(1).forward
    minimum = Overlap(to_networkx(graph)).min_budget("all")
    with pytest.raises(BudgetError) as info:
        run("overlap", GraphForm(graph), budget=Budget(minimum - 1))
    message = str(info.value)
    assert message.startswith("`memory_budget` ") and f"pass `memory_budget={minimum}` or more" in message
    assert "(`budget_scope='all'`)" in message and "--" not in message
    cli = in_flags(info.value, "schedule")
    assert cli.startswith("--memory-budget ") and f"pass --memory-budget {minimum} or more" in cli
    assert "(--budget-scope all)" in cli
    assert isinstance(info.value, DcschedError) and info.value.exit_code == 2


def test_cli_wording_leaves_unquoted_names_alone():
    assert in_flags(DcschedError("memory_budget in a plain error"), "schedule") == "memory_budget in a plain error"
    assert in_flags(OptionError("k", "must be a whole number"), "schedule") == "k must be a whole number"


# -- Plan -----------------------------------------------------------------------------------------------

def test_plan_type():
    plan = Plan(["a", "b", "output"])
    assert plan.order == ("a", "b", "output") and plan.buckets == () and dict(plan.residency) == {}
    assert plan.residency_of(3) == "sharded" and len(plan) == 3
    kept = Plan(("a",), buckets=[Bucket("reduce", ["r1", "r2"], [1, 2])], residency={1: "kept", 2: "replicated"})
    assert kept.buckets == (Bucket("reduce", ("r1", "r2"), (1, 2)),)
    assert kept.residency_of(1) == "kept" and kept.residency_of(2) == "replicated" and kept.residency_of(9) == "sharded"
    assert kept.with_order(["z"]).order == ("z",) and kept.with_order(["z"]).buckets == kept.buckets
    with pytest.raises(dataclasses.FrozenInstanceError):
        kept.order = ()
    with pytest.raises(TypeError):
        kept.residency[1] = "sharded"  # read-only
    with pytest.raises(ValueError, match="residency"):
        Plan(("a",), residency={1: "cached"})
    with pytest.raises(ValueError, match="bucket kind"):
        Bucket("broadcast", ("a",), (1,))
    with pytest.raises(ValueError, match="one ds_id per member"):
        Bucket("allgather", ("a", "b"), (1,))


def test_deepcompile_fills_buckets_with_its_fused_groups():
    graph = layered_stack(2).forward
    form = GraphForm(graph)
    for budget in (Budget.unlimited(), Budget(Overlap(form).fast_free.peak_bytes)):
        plan = run("deepcompile", form, budget=budget)
        groups = DeepCompile(form).plan(budget.bytes).groups
        assert [list(b.members) for b in plan.buckets] == groups
        assert any(len(b.members) > 1 for b in plan.buckets)
        position = {name: i for i, name in enumerate(plan.order)}
        for bucket in plan.buckets:
            assert bucket.kind == "allgather"
            assert [form.ds_id[form.index[m]] for m in bucket.members] == list(bucket.ds_ids)
            # A bucket's members run back to back in the order.
            first = position[bucket.members[0]]
            assert [position[m] for m in bucket.members] == list(range(first, first + len(bucket.members)))
        gathers = sum(1 for k in form.kind if k == 2)  # ALLGATHER
        assert sum(len(b.members) for b in plan.buckets) == gathers


def test_other_schedulers_return_plain_plans():
    form = GraphForm(random_graph(1))
    for algo in schedulers.available():
        plan = run(algo, form)
        assert isinstance(plan, Plan) and len(plan.order) == len(form) and dict(plan.residency) == {}
        if algo not in ("deepcompile", "fsdp", "overlap-plan"):  # the three that fuse collectives
            assert plan.buckets == ()


# -- the entry ------------------------------------------------------------------------------------------

def test_run_is_the_one_entry_and_matches_dcsched_schedule():
    graph = layered_stack(2).backward
    form = GraphForm(graph)
    for algo in schedulers.available():
        plan = run(algo, form, budget=Budget.unlimited())
        assert list(plan.order) == [n.name for n in dcsched.schedule(graph, algo, memory_budget="unlimited").nodes] \
            if schedulers.get(algo).takes_budget else [n.name for n in dcsched.schedule(graph, algo).nodes]
        assert plan.order[-1] == "output"
    # The same order from the FX graph's form and from the networkx view's form.
    assert run("fast-free", GraphForm(to_networkx(graph))).order == run("fast-free", form).order
    assert dcsched.reorder.plan(graph, "deepcompile").buckets == run("deepcompile", form).buckets


def test_run_takes_a_form_and_a_budget_object():
    graph = layered_stack(1).forward
    with pytest.raises(TypeError, match="GraphForm"):
        run("fast-free", to_networkx(graph))
    with pytest.raises(OptionError, match="budget=Budget"):
        run("overlap", GraphForm(graph), memory_budget=10**9)
    with pytest.raises(OptionError, match="k is not an option of scheduler 'fast-free'"):
        run("fast-free", GraphForm(graph), k=3)
    with pytest.raises(ScheduleError, match="unknown scheduler"):
        run("no-such", GraphForm(graph))
    # A scheduler without a budget ignores one.
    assert run("fast-free", GraphForm(graph), budget=Budget(1)).order == run("fast-free", GraphForm(graph)).order


def test_registry_reads_budget_parameters():
    assert schedulers.get("overlap").options == ("memory_budget", "budget_scope")
    assert schedulers.get("overlap").takes_budget and schedulers.get("overlap").takes_scope
    assert schedulers.get("deepcompile").options == ("memory_budget",)
    assert schedulers.get("deepcompile").takes_budget and not schedulers.get("deepcompile").takes_scope
    assert schedulers.get("prefetch-ahead").options == ("k",) and not schedulers.get("prefetch-ahead").takes_budget


def test_a_scheduler_receives_numbers_never_text():
    seen = {}

    @schedulers.register("test-budget-probe", description="test only")
    def probe(form, *, budget_bytes: float, budget_scope: str) -> Plan:
        seen.update(bytes=budget_bytes, scope=budget_scope)
        return Plan(form.names)

    try:
        graph = layered_stack(1).forward
        dcsched.schedule(graph, "test-budget-probe", memory_budget="40GiB", budget_scope="gathered")
        assert seen == {"bytes": 40 * 2**30, "scope": "gathered"}
        dcsched.schedule(graph, "test-budget-probe")
        assert seen == {"bytes": math.inf, "scope": "all"}
        run("test-budget-probe", GraphForm(graph), budget=Budget(123))
        assert seen == {"bytes": 123, "scope": "all"}
    finally:
        schedulers.registry.unregister("test-budget-probe")


def test_a_scheduler_returning_a_bad_order_is_a_schedule_error():
    @schedulers.register("test-bad-order", description="test only")
    def bad(form) -> Plan:
        return Plan(list(reversed(form.names)))

    @schedulers.register("test-no-plan", description="test only")
    def no_plan(form):
        return list(form.names)

    try:
        graph = layered_stack(1).forward
        with pytest.raises(ScheduleError, match="test-bad-order' returned an invalid order"):
            run("test-bad-order", GraphForm(graph))
        with pytest.raises(ScheduleError, match="not a Plan"):
            run("test-no-plan", GraphForm(graph))
    finally:
        schedulers.registry.unregister("test-bad-order")
        schedulers.registry.unregister("test-no-plan")


def test_schedule_refuses_a_budget_for_a_scheduler_without_one():
    with pytest.raises(OptionError, match="takes no memory budget"):
        dcsched.schedule(layered_stack(1).forward, "fast-free", memory_budget="1GiB")


# -- the one refusal: a budget (or scope) given to a scheduler that takes none --------------------------

REFUSALS = {"memory_budget": "memory_budget is given, but scheduler '{}' takes no memory budget",
            "budget_scope": "budget_scope is given, but scheduler '{}' takes no budget scope"}


def _python_paths(algo: str, option: str, value):
    """Every Python entry that takes a budget, each given ``option=value`` for scheduler ``algo``."""
    graph = layered_stack(1).forward
    given = {option: value}
    return {
        "dcsched.schedule": lambda: dcsched.schedule(graph, algo, **given),
        "dcsched.plan": lambda: dcsched.reorder.plan(graph, algo, **given),
        "dcsched.order": lambda: dcsched.reorder.order(graph, algo, **given),
        "dcsched.backend": lambda: dcsched.backend(algo=algo, **given),
        "TrainOptions.check": lambda: TrainOptions(algo=algo, **given).check(),
        "TrainOptions.budget": lambda: TrainOptions(algo=algo, **given).budget(_bundle()),
        "ScheduleOptions.resolve": lambda: ScheduleOptions(algo=algo, **given).resolve(),
    }


@pytest.mark.parametrize("algo, option, value", [
    ("fast-free", "memory_budget", "1GiB"), ("none", "memory_budget", "unlimited"),
    ("fast-free", "budget_scope", "gathered"), ("deepcompile", "budget_scope", "all"),  # a budget, but no scope
])
def test_one_refusal_from_every_python_path(algo, option, value):
    for path, call in _python_paths(algo, option, value).items():
        with pytest.raises(OptionError) as raised:
            call()
        assert (raised.value.option, str(raised.value)) == (option, REFUSALS[option].format(algo)), path


def test_a_budget_object_is_refused_as_a_budget_text_is():
    with pytest.raises(OptionError) as raised:
        dcsched.reorder.plan(layered_stack(1).forward, "list", budget=Budget.unlimited())
    assert str(raised.value) == REFUSALS["memory_budget"].format("list")


def test_a_budget_any_selected_scheduler_takes_is_not_refused():
    selection = ScheduleOptions(algo="none,overlap,deepcompile", memory_budget="6GiB",
                                budget_scope="gathered").resolve()
    assert selection.budget == Budget(6 * 2**30, "gathered") and selection.budgeted == ["overlap", "deepcompile"]
    with pytest.raises(OptionError) as raised:
        ScheduleOptions(algo="none,list", memory_budget="6GiB").resolve()
    assert str(raised.value) == "memory_budget is given, but scheduler 'none', 'list' takes no memory budget"


@pytest.mark.parametrize("command, option, flags", [
    ("schedule", "memory_budget", ["--memory-budget", "1GiB"]),
    ("schedule", "memory_budget", ["-O", "memory_budget=1"]),
    ("train", "memory_budget", ["--memory-budget", "1GiB"]),
    ("train", "memory_budget", ["-O", "memory_budget=1GiB"]),
    ("schedule", "budget_scope", ["--budget-scope", "gathered"]),
    ("train", "budget_scope", ["--budget-scope", "all"]),
])
def test_one_refusal_on_the_command_line_exit_2_one_line(tmp_path, capsys, command, option, flags):
    from dcsched.cli import run as cli
    marker = tmp_path / "ran"
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    source = dcsched.save(dcsched.replay.example_bundle(), tmp_path / "in.pt") if command == "schedule" else script
    before = sorted(tmp_path.iterdir())
    assert cli([command, str(source), "--algo", "fast-free", *flags]) == 2
    err = capsys.readouterr().err
    in_words = REFUSALS[option].format("fast-free").replace(option, "--" + option.replace("_", "-"), 1)
    assert err == f"dcsched: error: {in_words}\n", err
    assert sorted(tmp_path.iterdir()) == before and not marker.exists()  # nothing ran, nothing written
