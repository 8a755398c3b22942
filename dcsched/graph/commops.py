"""The ZeRO-3 communication ops registered with torch, from the table of collective kinds.

Every kind of :mod:`dcsched.collectives` becomes an op ``torch.ops.dcsched.<op>``
with the row's schema (DeepSpeed DeepCompile's for the built-in kinds), and
``torch.ops.dc.<op>`` when a graph built by DeepSpeed needs them
(:func:`ensure_deepspeed_ops`). Importing this module registers the
``dcsched`` ops; both the bundle loader (which looks ops up by name) and the
runtime (which runs them) import it, so neither needs the other.

A kernel runs the row's hook on the runtime installed in
:mod:`dcsched.runtime.ops` (imported on a kernel's first call: building and
loading graphs runs no kernel). A kind registered later is defined the next
time the table changes or :func:`define` runs; one taken out of the table
is taken out of torch's registry too.

>>> import torch
>>> str(torch.ops.dcsched.release_param.default._schema)
'dcsched::release_param(Tensor(a) a, int graph_id, int id, int n_users) -> Tensor(a)'
"""

from __future__ import annotations

from typing import Callable

import torch

from dcsched import collectives

NAMESPACE = "dcsched"
#: DeepSpeed's namespace; graphs built by DeepSpeed use it.
DEEPSPEED_NAMESPACE = "dc"

#: (namespace, op) -> the library fragment defining it.
_libraries: dict[tuple[str, str], torch.library.Library] = {}
#: Namespaces whose ops dcsched defines (not DeepSpeed's own extension).
_owned: set[str] = set()
_runtime_module = None


def _runtime():
    """The installed runtime (:data:`dcsched.runtime.ops.RUNTIME`); the runtime is a floor above, so it is
    imported when a kernel first runs."""
    global _runtime_module
    if _runtime_module is None:
        from dcsched.runtime import ops
        _runtime_module = ops
    return _runtime_module.RUNTIME


def _kernel(hook, schema: str) -> Callable:
    """A kernel calling ``hook`` (a runtime method's name, or a function of the runtime and the arguments) with
    every argument, defaults filled in (torch passes only those given)."""
    parsed = torch._C.parse_schema(schema)
    defaults = tuple(argument.default_value for argument in parsed.arguments)
    if isinstance(hook, str):
        def kernel(*args):
            return getattr(_runtime(), hook)(*args, *defaults[len(args):])
    else:
        def kernel(*args):
            return hook(_runtime(), *args, *defaults[len(args):])
    return kernel


def _define_one(namespace: str, kind: collectives.CollectiveKind) -> None:
    lib = torch.library.Library(namespace, "FRAGMENT")
    lib.define(kind.schema)
    kernel, fake = _kernel(kind.kernel, kind.schema), _kernel(kind.fake, kind.schema)
    for key in ("CPU", "CUDA"):
        lib.impl(kind.op, kernel, key)
    lib.impl(kind.op, fake, "Meta")
    torch.library.register_fake(f"{namespace}::{kind.op}", fake, lib=lib)
    _libraries[(namespace, kind.op)] = lib


def define(namespace: str = NAMESPACE) -> None:
    """Register every kind of the table not yet registered in ``namespace``, and take out of torch's registry
    the ops of kinds no longer in the table."""
    _owned.add(namespace)
    _sync()


def _sync() -> None:
    ops = collectives.op_names()
    for key in [key for key in _libraries if key[1] not in ops]:
        _libraries.pop(key)._destroy()
    for namespace in sorted(_owned):
        for kind in collectives.kinds():
            if (namespace, kind.op) not in _libraries:
                _define_one(namespace, kind)


def _namespace_has_ops(namespace: str) -> bool:
    try:
        packet = getattr(getattr(torch.ops, namespace), collectives.kinds()[0].op, None)
        return packet is not None and hasattr(packet, "default")
    except (AttributeError, RuntimeError):
        return False


def ensure_deepspeed_ops() -> None:
    """Make ``torch.ops.dc.*`` available, backed by dcsched's kernels.

    Registered lazily, only when a graph needs them, and only if DeepSpeed has
    not registered its own: defining them at import time would clash with
    DeepSpeed's extension when both are loaded in one process.
    """
    if DEEPSPEED_NAMESPACE not in _owned and not _namespace_has_ops(DEEPSPEED_NAMESPACE):
        define(DEEPSPEED_NAMESPACE)


collectives.on_change(_sync)
if NAMESPACE not in _owned and not _namespace_has_ops(NAMESPACE):
    define(NAMESPACE)
