import os
import sys

# Test helpers (tests/bundles.py, ...) import as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def two_rank_training(tmp_path_factory):
    """One 2-rank gloo spawn training every configuration the 2-rank tests read (compiles dominate the time).

    GPT and Llama under none, fast-free, overlap and overlap-plan (buckets, kept parameters), GPT's overlap
    again under ``train_runs.OVERLAP_BUDGET``, the BatchNorm ConvNet under overlap, GPT's overlap with
    ``compute="inductor"``; 20 steps each. GPT's fast-free run checkpoints after step
    ``train_runs.CHECKPOINT_AT``, at ``["checkpoint"]``. ``["ranks"]``: each rank's results by label.
    """
    import train_runs as runs
    root = tmp_path_factory.mktemp("train2")
    checkpoint = str(root / "gpt-fast-free.ckpt")
    plan = [(f"{name}-{algo}", name, algo, 20, 4, {"save": (checkpoint, runs.CHECKPOINT_AT)} if
             (name, algo) == ("gpt", "fast-free") else {})
            for name in ("gpt", "llama") for algo in ("none", "fast-free", "overlap", "overlap-plan")]
    plan.append(("gpt-overlap-budget", "gpt", "overlap", 20, 4,
                 {"memory_budget": runs.OVERLAP_BUDGET, "budget_scope": "all"}))
    plan.append(("convnet-bn-overlap", "convnet-bn", "overlap", 20, 4, {}))
    plan.append(("gpt-overlap-inductor", "gpt", "overlap", 20, 4, {"compute": "inductor"}))
    return {"ranks": runs.spawn(root / "out", 2, plan), "checkpoint": checkpoint}
