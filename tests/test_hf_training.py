"""Hugging Face models (built from configs) trained by dcsched over 2 and 3 gloo ranks, as a user trains them.

Default settings (the measured cost model, each rank's times skewed on purpose), every rank fed the same
batches: the losses, the clipped gradient norms and the evaluation losses under no_grad equal one eager
process's within 1e-5 relative for GPT-2, Llama, Mixtral (4 experts), T5 and BERT (with dropout) and ViT under
none, fast-free, overlap and simple-prefetch. GPT-2 breaks into several graphs (transformers' logging in its
forward). save_pretrained on 2 ranks writes full weights a plain from_pretrained loads; the Trainer
(torch_compile=True) under ``torchrun -m dcsched train`` on 2 ranks gives the losses of the script alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gloo import GLOO_MARKS

pytest.importorskip("transformers")
import hf_models  # noqa: E402
import train_runs as runs  # noqa: E402

pytestmark = [*GLOO_MARKS, pytest.mark.slow]

MODELS = ("gpt2", "llama", "mixtral", "t5", "bert", "vit")
ALGOS = ("none", "fast-free", "overlap", "simple-prefetch")
STEPS = 3
HABITS = {"clip": True, "evaluate": True}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return tmp_path_factory.mktemp("hf-save") / "gpt2"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, saved):
    plan = [(f"{model}-{algo}", f"hf-{model}", algo, STEPS, 0, HABITS) for model in MODELS for algo in ALGOS]
    plan.append(("gpt2-saved", "hf-gpt2", "overlap", STEPS, 0, {**HABITS, "save": str(saved)}))
    return runs.spawn(tmp_path_factory.mktemp("hf2") / "out", 2, plan, skew=True)


def _close(measured, expected, what):
    assert len(measured) == len(expected), what
    assert torch.allclose(torch.tensor(measured), torch.tensor(expected), rtol=1e-5, atol=0), (what, measured, expected)


@pytest.mark.parametrize("model", MODELS)
def test_every_algorithm_trains_as_one_eager_process(two_ranks, model):
    eager = hf_models.train(model, STEPS, **HABITS)
    for algo in ALGOS:
        for rank in range(2):
            result = two_ranks[rank][f"{model}-{algo}"]
            for what in ("losses", "norms", "evaluated"):
                _close(result[what], eager[what], (model, algo, rank, what))


def test_save_pretrained_on_two_ranks_gives_full_weights_a_plain_model_loads(two_ranks, saved):
    import transformers
    loaded = transformers.GPT2LMHeadModel.from_pretrained(saved)
    eager = hf_models.train("gpt2", STEPS, **HABITS, keep_model=True)["model"]
    expected = eager.state_dict()
    for name, value in loaded.state_dict().items():
        assert value.shape == expected[name].shape, name
        assert torch.allclose(value, expected[name], rtol=1e-4, atol=1e-6), name
    assert two_ranks[0]["gpt2-saved"]["full_state_dict_matches"] is True


def test_three_ranks_with_uneven_parameters(tmp_path):
    # GPT-2's embeddings (64 x 32) and every width-32 vector do not divide by 3.
    results = runs.spawn(tmp_path, 3, [("gpt2", "hf-gpt2", "fast-free", STEPS, 0, HABITS)], skew=True)
    eager = hf_models.train("gpt2", STEPS, **HABITS)
    for rank in range(3):
        for what in ("losses", "norms", "evaluated"):
            _close(results[rank]["gpt2"][what], eager[what], (rank, what))


def _trainer_losses(tmp_path: Path, dcsched_algo: str | None) -> list[dict]:
    """The script alone in one process (batch 4), or under ``torchrun -m dcsched train`` on 2 ranks (2 each)."""
    script = Path(__file__).with_name("hf_trainer_script.py")
    if dcsched_algo is None:
        cmd = [sys.executable, str(script), str(tmp_path / "plain"), "4"]
    else:
        from test_cli_train_distributed import torchrun
        cmd = [*torchrun(), "--nproc-per-node", "2", "--master-port", str(runs.free_port()), "-m", "dcsched",
               "train", str(script), "--algo", dcsched_algo, "--timeout", "120", "--", str(tmp_path / "dcsched"), "2"]
    from test_cli_train_distributed import _env
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("logged ")]


def _saved_weights(directory: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(directory / "model.safetensors"))


def test_trainer_with_torch_compile_on_two_ranks_trains_as_one_process(tmp_path):
    # accelerate wraps the model in DDP under torchrun; dcsched compiles the module inside (DDP stays idle).
    # The saving arguments are the defaults: the Trainer's checkpoint at the end and save_model(), both written by
    # the main process, gather on every rank under dcsched train.
    plain = _trainer_losses(tmp_path, None)
    scheduled = _trainer_losses(tmp_path, "overlap")
    assert len(plain) == len(scheduled) == 4
    for mine, theirs in zip(scheduled, plain):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)  # the global norm, clipped alike
    for saved in (Path("checkpoint-4"), Path(".")):
        ours, theirs = _saved_weights(tmp_path / "dcsched" / saved), _saved_weights(tmp_path / "plain" / saved)
        assert sorted(ours) == sorted(theirs)
        for name, value in theirs.items():
            assert ours[name].shape == value.shape, name
            torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=name)
