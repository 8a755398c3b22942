"""Which ops a bundle may call: a list of side-effect-free ops shipped as data, and the rules that make it.

A stored graph names its ops (``aten.mm.default``); loading calls nothing that
is not on :data:`LIST_FILE`, a text file in this package of qualified op
names, one a line. The list holds ops that compute on their tensor inputs and
nothing else: no file or console I/O, no file-backed storage, no callback into
the host, no global state changed (random-number generator state included:
replay seeds the generator, an op may draw from it but not read, set or
reseed it), no write to an input. ``tools/allowed_ops.py`` makes it from the
installed torch's op registry, keeping each ``aten`` and ``prims`` overload
that :func:`schema_refusal` lets through, then dcsched's and DeepSpeed's
ZeRO-3 ops (:data:`ZERO3_OPS`); it also captures real models and fails if
one of them uses an op the rules refuse. ``operator.*`` functions are
allowed by :mod:`dcsched.bundle.graph_encoding`, not here.

:func:`schema_refusal` judges an op by its schema and tags: a schema that
marks an argument written (``Tensor(a!)``, every in-place and ``out=``
overload), an op that returns nothing (it can act only by side effect), an
argument or result that is no tensor, number, string, device or generator
(a ``Storage``, a ``Stream``, a TorchScript class), a tag that says the op
mutates or may; and by name, :data:`DENIED`: ops whose schema looks pure but
whose kernel does I/O, prints, raises with stored text or writes an input its
schema does not mark.

>>> schema_refusal(torch.ops.aten.mm.default) is None
True
>>> schema_refusal(torch.ops.aten.from_file.default)
'it maps a file into a tensor (opens, creates and grows files)'
>>> schema_refusal(torch.ops.aten.add_.Tensor)
'it writes to its input in place (a scheduler would not keep its order against the other readers of that tensor)'
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import torch

from dcsched import collectives

#: The list, in this package.
LIST_FILE = "allowed_ops.txt"
#: Namespaces whose ops the list takes from torch's registry by :func:`schema_refusal`.
DERIVED_NAMESPACES = ("aten", "prims")
#: The built-in ZeRO-3 ops a bundle holds (:mod:`dcsched.collectives`): dcsched's own and DeepSpeed's (``dc``),
#: both with DeepSpeed's schemas. A kind registered later is allowed too (:func:`check_allowed`).
ZERO3_OPS = collectives.qualified_ops()

_FILES = "it maps a file into a tensor (opens, creates and grows files)"
_PRINTS = "it prints to standard output"
_RAISES = "it raises an error carrying text from the file (a check of the tracer's, not a computation)"
_TRACER = "it constrains or orders the tracer's symbolic values and effects, not tensors"
_HIDDEN_WRITE = "it writes to an input its schema does not mark as written"
_RUNNING_STATS = "it updates its running-statistics inputs in place, which its schema does not mark"
#: Ops (``namespace.name``, every overload) refused by name, with what they do beyond computing.
DENIED: dict[str, str] = {
    "aten.from_file": _FILES,
    "aten._print": _PRINTS,
    **dict.fromkeys(("aten._assert_async", "aten._assert_scalar", "aten._assert_tensor_metadata",
                     "aten._functional_assert_async", "aten._functional_assert_scalar"), _RAISES),
    **dict.fromkeys(("aten.sym_constrain_range", "aten.sym_constrain_range_for_size",
                     "aten._functional_sym_constrain_range", "aten._functional_sym_constrain_range_for_size",
                     "aten._make_dep_token", "prims._make_token", "prims._sink_tokens"), _TRACER),
    **dict.fromkeys(("aten._copy_from", "aten._copy_from_and_resize"), _HIDDEN_WRITE),
    **dict.fromkeys(("aten.native_batch_norm", "aten.batch_norm", "aten._batch_norm_impl_index",
                     "aten.cudnn_batch_norm", "aten.miopen_batch_norm", "aten.instance_norm",
                     "aten.batch_norm_update_stats", "aten.batch_norm_gather_stats",
                     "aten.batch_norm_gather_stats_with_counts"), _RUNNING_STATS),
    **dict.fromkeys(("aten._cudnn_rnn", "aten.miopen_rnn"), "it advances its dropout-state input in place, "
                                                              "which its schema does not mark"),
    "aten._backward": "it runs autograd's backward (hooks, gradients accumulated into .grad)",
    "aten.get_gradients": "it reads a distributed autograd context",
    **dict.fromkeys(("aten._cufft_set_plan_cache_max_size", "aten._cufft_clear_plan_cache"),
                    "it changes a process-wide cache"),
}
#: Words in an op's name that stand for what the list never holds, whatever torch adds later.
DENIED_WORDS = {"_test_": "it is one of torch's own test ops (some warn, some exercise the dispatcher)",
                "print": _PRINTS, "file": _FILES, "save": "it may write to a file", "load": "it may read a file",
                "rng_state": "it reads or sets the random-number generator's state",
                "seed": "it reads or sets the random-number generator's seed"}
#: Tags that say an op writes, or may write, to its inputs.
DENIED_TAGS = ("inplace", "inplace_view", "out", "out_variant", "maybe_aliasing_or_mutating")
#: Schema types (``kind()``, inside Optional and List) an allowed op takes and returns.
PLAIN_TYPES = frozenset({"TensorType", "IntType", "SymIntType", "FloatType", "SymFloatType", "BoolType",
                         "SymBoolType", "NumberType", "StringType", "DeviceObjType", "GeneratorType"})
_WRITES = "it writes to its input in place (a scheduler would not keep its order against the other readers of " \
          "that tensor)"


def _type_refusal(schema_type: Any) -> str | None:
    kind = schema_type.kind()
    if kind in ("OptionalType", "ListType"):
        return next(filter(None, map(_type_refusal, schema_type.containedTypes())), None)
    return None if kind in PLAIN_TYPES else f"its schema takes or returns a {schema_type} (not tensors, numbers, " \
                                            "strings or devices)"


def schema_refusal(op: torch._ops.OpOverload) -> str | None:
    """Why ``op`` is not side-effect free by its schema, tags and name (:data:`DENIED`), or None if it is."""
    namespace, name, overload = op.namespace, op._opname, op._overloadname
    if f"{namespace}.{name}" in DENIED:
        return DENIED[f"{namespace}.{name}"]
    word = next((word for word in DENIED_WORDS if word in name), None)
    if word is not None:
        return DENIED_WORDS[word]
    schema = op._schema
    written = any(a.alias_info is not None and a.alias_info.is_write for a in [*schema.arguments, *schema.returns])
    if schema.is_mutable or written or overload == "out" or overload.endswith("_out"):
        return _WRITES
    tags = {str(tag).rpartition(".")[2] for tag in op.tags}
    tagged = sorted(tags.intersection(DENIED_TAGS))
    if tagged:
        return f"torch tags it {tagged[0]} (it writes, or may write, to its inputs)"
    if not schema.returns:
        return "it returns nothing, so it acts only by its side effects"
    return next(filter(None, (_type_refusal(a.type) for a in [*schema.arguments, *schema.returns])), None)


def registered_overloads(namespaces=DERIVED_NAMESPACES) -> list[str]:
    """The qualified names (``aten.add.Tensor``) of every overload torch's dispatcher lists in ``namespaces``."""
    names = []
    for key in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = key.partition("::")
        if namespace in namespaces:
            op, _, overload = rest.partition(".")
            names.append(f"{namespace}.{op}.{overload or 'default'}")
    return sorted(names)


def resolve(name: str) -> torch._ops.OpOverload:
    """The op overload of a qualified name the dispatcher lists (:func:`registered_overloads`)."""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def derive() -> list[str]:
    """The list as the installed torch makes it: every ``aten`` / ``prims`` overload :func:`schema_refusal`
    lets through, then :data:`ZERO3_OPS`. Names starting with ``__`` (``aten.__and__``) are left out: the loader
    looks no such name up (:func:`dcsched.bundle.checks.check_op_name`); graphs call ``bitwise_and``."""
    return [name for name in registered_overloads() if not name.split(".")[1].startswith("__")
            and schema_refusal(resolve(name)) is None] + list(ZERO3_OPS)


@functools.cache
def allowed_ops() -> frozenset[str]:
    """The shipped list (:data:`LIST_FILE`): qualified op names; ``#`` starts a comment line."""
    text = resources.files(__package__).joinpath(LIST_FILE).read_text(encoding="utf-8")
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


@functools.cache
def list_torch_version() -> str:
    """The torch version the shipped list was made from (its ``# torch`` line)."""
    text = resources.files(__package__).joinpath(LIST_FILE).read_text(encoding="utf-8")
    return next((line.split()[2] for line in text.splitlines() if line.startswith("# torch ")), "unknown")


def check_allowed(name: str, registered: bool) -> None:
    """Refuse an op not on the list, in one line naming it and why: ``op 'aten.from_file.default' is not
    allowed: ...``. ``name`` is qualified with its overload; ``registered``: whether torch's dispatcher lists
    it (only then is it looked up, to say why).

    >>> check_allowed("aten.mm.default", True)
    >>> check_allowed("aten._print.default", True)
    Traceback (most recent call last):
    ...
    ValueError: op 'aten._print.default' is not allowed: it prints to standard output
    """
    if name in allowed_ops() or name in collectives.qualified_ops():
        return
    namespace = name.partition(".")[0]
    why = None
    if namespace not in (*DERIVED_NAMESPACES, *collectives.NAMESPACES):
        why = "a bundle calls only aten and prims ops on dcsched's list, the ZeRO-3 ops and a few operator functions"
    elif registered:
        try:
            why = schema_refusal(resolve(name))
        except (AttributeError, RuntimeError):  # registered, yet torch.ops cannot name it: say only that it is off
            why = None
    why = why or (f"it is not on dcsched's list of side-effect-free ops (made from torch {list_torch_version()}; "
                  "tools/allowed_ops.py makes it)")
    raise ValueError(f"op '{name}' is not allowed: {why}")
