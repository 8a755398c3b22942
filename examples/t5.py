"""Train a small T5-style encoder-decoder (dropout 0.1 everywhere, as T5's) on random tokens with torch.compile.

    python examples/t5.py --steps 20
    dcsched profile examples/t5.py -o t5.pt -- --layers 2 --d-model 256

Pure PyTorch, random initialisation, no downloads. Model sizes: see dcsched/examples.py. Its encoder's and
decoder's dropouts are independent, so a scheduler that moved random ops would change what it computes
(dcsched's keep them in order: docs/schedulers.md).
"""

import argparse

import torch

from dcsched.examples import build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="blocks in the encoder and in the decoder")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _, _ = build("t5", n_layers=args.layers, d_model=args.d_model, n_heads=args.heads, vocab=args.vocab,
                        seq=args.seq, batch=args.batch, dropout=args.dropout, device=device)
    model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(0)

    for step in range(args.steps):
        src, tgt = (torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(device)
                    for _ in range(2))
        loss = model(src[:, :-1].contiguous(), tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
