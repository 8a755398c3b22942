"""A training script whose ranks' batches differ in shape, as a loader with an uneven last batch gives them.

``uneven_batch_script.py [eager]``: the tiny GPT example (``examples/gpt.py``'s model) trained 3 steps with
AdamW; per step each of 3 ranks takes its own rows (4, 4, 4; then 4, 4, 3: a global batch of 11; then 2, 2, 2).
Under ``torchrun --nproc-per-node 3 -m dcsched train`` rank 0 prints ``losses [...]``, the ranks' mean loss per
step; with ``eager`` one process computes the same from the mean of the three ranks' losses.
"""

import json
import sys

import torch
import torch.distributed as dist

from dcsched.examples import build

ROWS = [(4, 4, 4), (4, 4, 3), (2, 2, 2)]
CONFIG = {"n_layers": 1, "d_model": 32, "n_heads": 2, "vocab": 64, "seq": 8}


def batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(1234)
    out = []
    for rows in ROWS:
        tokens = [torch.randint(0, CONFIG["vocab"], (n, CONFIG["seq"] + 1), generator=generator) for n in rows]
        out.append([(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens])
    return out


def main(eager: bool) -> None:
    model, _, _ = build("gpt", seed=0, batch=1, device="cpu", **CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank = 0 if eager else dist.get_rank()
    run = model if eager else torch.compile(model)
    losses = []
    for step in batches():
        loss = torch.stack([run(*inputs) for inputs in step]).mean() if eager else run(*step[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if not eager:
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        losses.append(float(mean))
    if rank == 0:
        print("losses", json.dumps(losses))


if __name__ == "__main__":
    main(sys.argv[1:] == ["eager"])
