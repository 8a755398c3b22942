"""``python -m dcsched`` (and ``torchrun -m dcsched``) runs the CLI."""

from dcsched.cli import main

if __name__ == "__main__":
    main()
