"""Train a small Llama-style decoder (RMSNorm, SwiGLU, rotary embeddings) on random tokens with torch.compile.

    python examples/llama.py --steps 20
    python examples/llama.py --steps 10 --save ckpt && python examples/llama.py --steps 20 --resume ckpt
    python examples/llama.py --checkpointing selective    # each block checkpointed (none, full, reentrant)
    dcsched profile examples/llama.py -o graph.pt -- --layers 4 --no-rotary

Pure PyTorch, random initialisation, no downloads. Model sizes: see dcsched/examples.py.
"""

import argparse
import contextlib

import torch
import torch._functorch.config

from dcsched.examples import CHECKPOINTING, build, checkpoint, resume


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--no-rotary", action="store_true", help="drop the rotary position embeddings")
    parser.add_argument("--bf16", action="store_true", help="run under bf16 autocast")
    parser.add_argument("--checkpointing", choices=CHECKPOINTING, default="none",
                        help="activation checkpointing of each block (selective: matmul outputs saved)")
    parser.add_argument("--activation-memory-budget", type=float, metavar="F",
                        help="torch._functorch.config.activation_memory_budget (0..1: what the compiler keeps)")
    parser.add_argument("--save", metavar="DIR", help="checkpoint model, optimizer and data stream to DIR at the end")
    parser.add_argument("--resume", metavar="DIR", help="load DIR's checkpoint first, go on from its step to --steps")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _, _ = build("llama", n_layers=args.layers, d_model=args.d_model, n_heads=args.heads, vocab=args.vocab,
                        seq=args.seq, batch=args.batch, rotary=not args.no_rotary, device=device,
                        checkpointing=args.checkpointing)
    if args.activation_memory_budget is not None:
        torch._functorch.config.activation_memory_budget = args.activation_memory_budget
    model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(0)
    autocast = (torch.autocast(device_type=device, dtype=torch.bfloat16) if args.bf16
                else contextlib.nullcontext())

    # dcsched.load_checkpoint / save_checkpoint, sharded (under dcsched train) or not, as the run that saved it
    start = resume(args.resume, model, optimizer, generator) if args.resume else 0
    for step in range(start, args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(device)
        idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        with autocast:
            loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")
    if args.save:
        checkpoint(args.save, model, optimizer, generator, max(start, args.steps))


if __name__ == "__main__":
    main()
