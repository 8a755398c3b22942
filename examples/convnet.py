"""Train a small ResNet-style convolutional classifier on random images with torch.compile.

    python examples/convnet.py --steps 20
    python examples/convnet.py --steps 10 --save ckpt && python examples/convnet.py --steps 20 --resume ckpt
    dcsched profile examples/convnet.py -o graph.pt -- --layers 3 --width 64

Pure PyTorch, random initialisation, no downloads. Model sizes: see dcsched/examples.py.
"""

import argparse
import contextlib

import torch

from dcsched.examples import build, checkpoint, resume


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bf16", action="store_true", help="run under bf16 autocast")
    parser.add_argument("--save", metavar="DIR", help="checkpoint model, optimizer and data stream to DIR at the end")
    parser.add_argument("--resume", metavar="DIR", help="load DIR's checkpoint first, go on from its step to --steps")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _, _ = build("convnet", n_layers=args.layers, width=args.width, n_classes=args.classes,
                        image=args.image, batch=args.batch, device=device)
    model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    autocast = (torch.autocast(device_type=device, dtype=torch.bfloat16) if args.bf16
                else contextlib.nullcontext())

    # dcsched.load_checkpoint / save_checkpoint, sharded (under dcsched train) or not, as the run that saved it
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
