"""What tests/test_train_eager.py runs on 2 gloo ranks: eager code around a sharded module.

Every rank is fed the same batches, so each rank's results must equal one plain process's.
"""

from __future__ import annotations

from pathlib import Path

import torch

import hf_models
import train_runs as runs

STEPS = 3
#: generate()'s prompt (the first rows and tokens of the last batch) and how many tokens it adds, greedily.
PROMPT_ROWS, PROMPT_TOKENS, NEW_TOKENS = 2, 4, 3


def checkpointed_llama(algo: str | None) -> dict:
    """A 2-layer Hugging Face Llama with non-reentrant gradient checkpointing, trained ``STEPS`` steps (dcsched
    with ``algo``, its default cost model; None: plain eager), then evaluated eagerly on the uncompiled model:
    ``logits`` under no_grad in eval mode and greedy ``generate`` tokens."""
    import dcsched
    torch._dynamo.reset()
    model = hf_models.build("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=hf_models.LR)
    run = model
    if algo is not None:
        dcsched.shard(model)
        run = torch.compile(model, backend=dcsched.backend(algo=algo), dynamic=False)
    losses = []
    batches = hf_models.batches("llama", STEPS)
    for batch in batches:
        loss = run(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.eval()
    ids = batches[-1]["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # the uncompiled module
        tokens = model.generate(ids[:PROMPT_ROWS, :PROMPT_TOKENS], max_new_tokens=NEW_TOKENS, do_sample=False,
                                use_cache=True, pad_token_id=0)
    return {"losses": losses, "logits": logits, "tokens": tokens}


class Hooked(torch.nn.Module):
    """A Linear then a LayerNorm; ``hooked``: a forward hook on the norm prints its weight after a graph break."""

    def __init__(self, hooked: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)
        if hooked:
            self.norm.register_forward_hook(_print_weight)

    def forward(self, x):
        return self.norm(self.lin(x)).square().mean()


def _print_weight(module, _args, _output):
    torch._dynamo.graph_break()
    print(module.weight)


def eager_gradients() -> dict:
    """The uncompiled sharded ``Hooked`` called eagerly with gradients on: its loss and the shards' gradients."""
    import dcsched
    model = Hooked()
    dcsched.shard(model)
    loss = model(torch.linspace(-1, 1, 24).view(4, 6))
    loss.backward()
    return {"loss": float(loss.detach()), "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}


def refused_hook() -> str:
    """The first line of what a compiled ``Hooked(hooked=True)`` raises."""
    import dcsched
    from dcsched.profile.scripts import unwrap_dynamo_error
    torch._dynamo.reset()
    model = Hooked(hooked=True)
    dcsched.shard(model)
    compiled = torch.compile(model, backend=dcsched.backend(algo="overlap"), dynamic=False)
    try:
        compiled(torch.ones(4, 6))
    except Exception as exc:  # noqa: BLE001 (TorchDynamo may wrap it)
        error = unwrap_dynamo_error(exc)
        return f"{type(error).__name__}: {error}"
    return "nothing raised"


def spawned(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """mp.spawn target: every run above on this rank, saved to ``out_dir/rank{rank}.pt``."""
    from dcsched.runtime.distributed import shutdown
    runs.init_gloo(rank, world_size, port)
    try:
        results = {"eager": eager_gradients(), "refused": refused_hook(), "llama": checkpointed_llama("overlap")}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        shutdown()


def spawn(out_dir: Path, world_size: int = 2) -> list[dict]:
    import torch.multiprocessing as mp
    out_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(spawned, args=(world_size, runs.free_port(), str(out_dir)), nprocs=world_size, join=True)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)]
