"""Options in one place: documented option dataclasses, the CLI's defaults and help taken from them, library
errors naming parameters and the CLI naming flags, and no import cycle between the cost models and profile."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from dcsched.cli import app
from dcsched.cli.app import in_flags
from dcsched.cli.options import default_of, help_of
from dcsched.costmodels.options import CostOptions, ProfileOptions
from dcsched.report.options import ScheduleOptions
from dcsched.errors import DcschedError, OptionError
from dcsched.train.options import ScriptOptions, TrainOptions

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("cls", [ProfileOptions, TrainOptions, ScriptOptions, ScheduleOptions])
def test_every_field_is_documented(cls):
    for field in dataclasses.fields(cls):
        assert field.metadata.get("help"), f"{cls.__name__}.{field.name} has no help"
        assert f"{field.name} :" in cls.__doc__ or f"{field.name}," in cls.__doc__, \
            f"{cls.__name__}'s docstring leaves out {field.name}"


def _params(command: str) -> dict:
    return {p.name: p for p in typer.main.get_command(app).commands[command].params}


@pytest.mark.parametrize("command, cls, fields", [
    ("profile", ProfileOptions, ["cost_model", "calibration", "gpu", "iters", "warmup", "world_size",
                                 "bandwidth_gbps", "latency_us", "progress"]),
    ("train", TrainOptions, ["algo", "memory_budget", "budget_scope", "cost_model", "gpu", "bandwidth_gbps",
                             "latency_us", "compute"]),
    ("train", ScriptOptions, ["timeout_s"]),
    ("schedule", ScheduleOptions, ["algo", "memory_budget", "budget_scope", "assume_zero"]),
])
def test_the_cli_takes_defaults_and_help_from_the_dataclasses(command, cls, fields):
    params = _params(command)
    for name in fields:
        assert params[name].default == default_of(cls, name), name
        assert params[name].help == help_of(cls, name), name


def test_the_cost_models_options_are_declared_once_for_profile_and_train():
    shared = [field.name for field in dataclasses.fields(CostOptions)]
    assert shared == ["cost_model", "iters", "warmup", "bandwidth_gbps", "latency_us", "gpu"]
    assert issubclass(ProfileOptions, CostOptions) and issubclass(TrainOptions, CostOptions)
    for name in shared:  # one help each: the profile's and the training's flags read the same text
        assert help_of(ProfileOptions, name) == help_of(TrainOptions, name) == help_of(CostOptions, name), name
    # Each command's documented defaults: the same, but for the compile-time profile's runs per node.
    differ = [name for name in shared if default_of(ProfileOptions, name) != default_of(TrainOptions, name)]
    assert differ == ["warmup"]
    assert (ProfileOptions().iters, ProfileOptions().warmup) == (5, 2)
    assert (TrainOptions().iters, TrainOptions().warmup) == (5, 1)
    # What training gives is what its profile runs with.
    given = TrainOptions(cost_model="analytic", gpu="h100", iters=3, warmup=0, bandwidth_gbps=50.0, latency_us=2.0)
    profile = given.profile_options(world_size=2)
    assert {name: getattr(profile, name) for name in shared} == given.cost_options()


def test_the_option_modules_declare_fields_with_one_helper():
    for module in ("costmodels/options.py", "train/options.py", "report/options.py", "cli/options.py"):
        text = (ROOT / "dcsched" / module).read_text()
        assert "def _field(" not in text and ("def help_field(" in text) == (module == "costmodels/options.py")


def test_collective_figures_default_to_the_table_and_reach_the_training_profile():
    assert (ProfileOptions().latency_us, ProfileOptions().bandwidth_gbps) == (None, None)
    assert "interconnect table" in help_of(ProfileOptions, "latency_us")
    assert "interconnect table" in help_of(ProfileOptions, "bandwidth_gbps")
    profile = TrainOptions(latency_us=5.0, bandwidth_gbps=40.0).profile_options(world_size=2)
    assert (profile.latency_us, profile.bandwidth_gbps, profile.world_size) == (5.0, 40.0, 2)
    assert TrainOptions().profile_options(world_size=2).latency_us is None


def test_help_names_flags_where_the_dataclass_names_fields():
    assert "``" in dataclasses.fields(ProfileOptions)[0].metadata["help"]
    assert "--gpu" in help_of(ProfileOptions, "cost_model") and "``" not in help_of(ProfileOptions, "cost_model")


def test_option_dataclasses_import_without_torch():
    code = ("import sys\nfrom dcsched.costmodels.options import ProfileOptions\n"
            "from dcsched.train.options import TrainOptions, ScriptOptions\n"
            "from dcsched.report.options import ScheduleOptions\nimport dcsched.cli\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("options, option, words", [
    (ProfileOptions(iters=0), "iters", "iters must be at least 1"),
    (ProfileOptions(world_size=0), "world_size", "world_size must be at least 1"),
    (ProfileOptions(bandwidth_gbps=0), "bandwidth_gbps", "bandwidth_gbps must be positive"),
    (ProfileOptions(latency_us=-1), "latency_us", "latency_us must not be negative"),
    (TrainOptions(latency_us=-1), "latency_us", "latency_us must not be negative"),
    (ProfileOptions(cost_model="analytic"), "gpu", "gpu is missing"),
    (ProfileOptions(cost_model="calibrated"), "calibration", "calibration is missing"),
    (ScriptOptions(timeout_s=0), "timeout_s", "timeout_s must be between"),
    (TrainOptions(algo="list", algo_options={"k": 1}), "algo_options", "algo_options has 'k'"),
])
def test_library_errors_name_the_parameter(options, option, words):
    with pytest.raises(OptionError) as raised:
        options.check()
    assert raised.value.option == option and words in str(raised.value) and "--" not in str(raised.value)


@pytest.mark.parametrize("error, command, line", [
    (OptionError("bandwidth_gbps", "must be positive (GB/s)"), "profile", "--bandwidth must be positive (GB/s)"),
    (OptionError("timeout_s", "must be between 0.1 and 604800 seconds"), "train",
     "--timeout must be between 0.1 and 604800 seconds"),
    (OptionError("algo_options", "has 'k'"), "train", "--option has 'k'"),
    (OptionError("nothing_like_it", "is odd"), "train", "nothing_like_it is odd"),
    (DcschedError("x.pt: exists already (pass `force=True` to replace it)"), "schedule",
     "x.pt: exists already (pass --force to replace it)"),
    (DcschedError("x.pt: exists already (pass `overwrite=True` to replace it)"), "profile",
     "x.pt: exists already (pass --force to replace it)"),
    (DcschedError("no device_time (pass `assume_zero=True` to count them as 0)"), "schedule",
     "no device_time (pass --assume-zero to count them as 0)"),
    (DcschedError("planned without data (`meta=True`): no values"), "replay",
     "planned without data (dcsched profile --meta): no values"),
    (DcschedError("run it with `compute='eager'`"), "train", "run it with --compute eager"),
    (DcschedError("tensor_size=3 on mm0"), "schedule", "tensor_size=3 on mm0"),
    (DcschedError("script.py failed: tensor(..., device='meta')"), "profile",
     "script.py failed: tensor(..., device='meta')"),  # quoted, not a suggestion: left alone
    (DcschedError("take `nothing_like_it=1`"), "profile", "take `nothing_like_it=1`"),
])
def test_the_cli_translates_parameters_into_its_flags(error, command, line):
    assert in_flags(error, command) == line


def _import_cycles():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycle_between_modules():
    tool = _import_cycles()
    assert tool.cycles(tool.graph(lambda name: name)) == []


def test_the_cost_models_import_nothing_from_profile():
    tool = _import_cycles()
    edges = tool.graph(tool.package_of, deferred=True)  # imports inside functions included
    assert "dcsched.profile" not in edges["dcsched.costmodels"]


def test_no_import_cycle_between_packages():
    tool = _import_cycles()
    assert tool.cycles(tool.graph(tool.package_of)) == []


def test_no_module_imports_from_a_lower_floor_up():
    tool = _import_cycles()
    assert tool.upward_imports() == []
    ground, graph, bundle = 0, 1, 2
    assert [tool.floor_of(name) for name in ("dcsched.collectives", "dcsched.plan", "dcsched.graph.commops",
                                             "dcsched.bundle.graph_encoding")] == [ground, ground, graph, bundle]
    assert tool.floor_of("dcsched.cli.app") == len(tool.FLOORS) - 1


def test_the_layer_check_names_an_import_from_a_lower_floor_up(tmp_path, monkeypatch):
    tool = _import_cycles()
    (tmp_path / "dcsched" / "graph").mkdir(parents=True)
    (tmp_path / "dcsched" / "__init__.py").write_text("")
    (tmp_path / "dcsched" / "graph" / "__init__.py").write_text("")
    (tmp_path / "dcsched" / "graph" / "specs.py").write_text("from dcsched.bundle.core import Bundle\n")
    (tmp_path / "dcsched" / "bundle").mkdir()
    (tmp_path / "dcsched" / "bundle" / "__init__.py").write_text("")
    (tmp_path / "dcsched" / "bundle" / "core.py").write_text("from dcsched.graph import specs\n")
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    monkeypatch.setattr(tool, "PACKAGE", tmp_path / "dcsched")
    assert tool.upward_imports() == ["dcsched.graph.specs (graph) imports dcsched.bundle.core (bundle)"]
    assert tool.main(["--layers"]) == 1
