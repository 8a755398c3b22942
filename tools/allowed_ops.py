"""Make ``dcsched/bundle/allowed_ops.txt``, the ops a bundle may call, from the installed torch.

    python tools/allowed_ops.py            # derive, check against real models, write the list
    python tools/allowed_ops.py --check    # exit 1 if the shipped list is not what this torch makes
    python tools/allowed_ops.py --no-capture

The list is every ``aten`` and ``prims`` overload in torch's op registry that
``dcsched.bundle.op_allowlist.schema_refusal`` lets through (no schema that
writes an argument, no ``out=`` or in-place overload, no mutating tag, a
result, plain argument types, not refused by name for I/O, printing,
file-backed storage, callbacks or generator state), then the ZeRO-3 ops.
Before writing, it captures the real models of ``tests/real_models.py``
(dcsched's examples and the Hugging Face models of ``tests/hf_models.py``)
and fails, naming the op and the rule, if one of them uses an op the rules
refuse: the rules are then wrong, not the model.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from dcsched.bundle import op_allowlist  # noqa: E402

TARGET = ROOT / "dcsched" / "bundle" / op_allowlist.LIST_FILE
HEADER = """\
# Ops a dcsched bundle may call: side-effect free by their schema, tags and name
# (dcsched/bundle/op_allowlist.py). Made by tools/allowed_ops.py; do not edit by hand.
# torch {version}
"""


def render(names: list[str]) -> str:
    return HEADER.format(version=torch.__version__) + "".join(f"{name}\n" for name in names)


def refused_by_real_models(allowed: set[str]) -> list[str]:
    """``'model: op (why)'`` for each op a captured real model uses that ``allowed`` lacks."""
    import real_models
    problems = []
    captures = [(label, lambda label=label: real_models.capture_example(label)) for label in real_models.EXAMPLES]
    captures += [(f"hf-{name}", lambda name=name: real_models.capture_hf(name)) for name in real_models.HF_MODELS]
    for label, capture in captures:
        for name in sorted(real_models.ops_of(capture()) - allowed):
            if name.startswith("operator."):
                continue
            why = op_allowlist.schema_refusal(op_allowlist.resolve(name)) if name.count(".") == 2 else None
            problems.append(f"{label}: {name} ({why or 'not derived'})")
        print(f"captured {label}", file=sys.stderr)
    return problems


def write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped list, write nothing")
    parser.add_argument("--no-capture", action="store_true", help="skip checking the real models' ops")
    args = parser.parse_args(argv)
    names = op_allowlist.derive()
    text = render(names)
    if args.check:
        same = TARGET.read_text(encoding="utf-8") == text
        verdict = "as this torch makes it" if same else "differs from what this torch makes"
        print(f"{TARGET.relative_to(ROOT)}: {verdict}")
        return 0 if same else 1
    if not args.no_capture:
        problems = refused_by_real_models(set(names))
        if problems:
            print("real models use ops the rules refuse; fix the rules:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 1
    write_atomically(TARGET, text)
    print(f"{TARGET.relative_to(ROOT)}: {len(names)} ops (torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
