"""Train a small vision transformer (ViT: patch embedding, class token, pre-norm blocks) on random images with torch.compile.

    python examples/vit.py --steps 20
    python examples/vit.py --steps 10 --save ckpt && python examples/vit.py --steps 20 --resume ckpt
    dcsched profile examples/vit.py -o vit.pt -- --layers 4 --d-model 256

Pure PyTorch, random initialisation, no downloads. Model sizes: see dcsched/examples.py.
"""

import argparse
import contextlib

import torch

from dcsched.examples import build, checkpoint, resume


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--patch", type=int, default=8, help="patch side in pixels (divides --image)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--bf16", action="store_true", help="run under bf16 autocast")
    parser.add_argument("--save", metavar="DIR", help="checkpoint model, optimizer and data stream to DIR at the end")
    parser.add_argument("--resume", metavar="DIR", help="load DIR's checkpoint first, go on from its step to --steps")
    args = parser.parse_args()
    if args.image % args.patch:
        parser.error(f"--image {args.image} is not a multiple of --patch {args.patch}")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _, _ = build("vit", n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                        n_classes=args.classes, image=args.image, patch=args.patch, batch=args.batch,
                        dropout=args.dropout, device=device)
    model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(0)
    autocast = (torch.autocast(device_type=device, dtype=torch.bfloat16) if args.bf16
                else contextlib.nullcontext())

    start = resume(args.resume, model, optimizer, generator) if args.resume else 0
    for step in range(start, args.steps):
        images = torch.randn(args.batch, 3, args.image, args.image, generator=generator).to(device)
        labels = torch.randint(0, args.classes, (args.batch,), generator=generator).to(device)
        with autocast:
            loss = model(images, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")
    if args.save:
        checkpoint(args.save, model, optimizer, generator, max(start, args.steps))


if __name__ == "__main__":
    main()
