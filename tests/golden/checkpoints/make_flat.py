"""Writes linear-adamw-flat-v1 with the save_checkpoint of dcsched 3a7779e (flattened shards, JSON items).

Run from a checkout of that commit: ``PYTHONPATH=. python tests/golden/checkpoints/make_flat.py OUT``.
"""

import sys

import torch

import dcsched


def main(out: str) -> None:
    whole = torch.nn.Linear(3, 2)
    with torch.no_grad():
        whole.weight.copy_(torch.arange(6.0).view(2, 3) / 10)
        whole.bias.copy_(torch.tensor([0.5, -0.5]))
    model = torch.nn.Linear(3, 2)
    model.load_state_dict(whole.state_dict())
    dcsched.shard(model)  # one process: each shard is the whole flattened parameter
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    whole(torch.ones(4, 3)).pow(2).sum().backward()
    for full, shard in zip(whole.parameters(), model.parameters()):
        shard.grad = full.grad.reshape(-1).clone()
    optimizer.step()
    dcsched.save_checkpoint(out, model, optimizer, extra={"step": 1})


if __name__ == "__main__":
    main(sys.argv[1])
