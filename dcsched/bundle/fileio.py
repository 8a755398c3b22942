"""The safetensors bundle file (versions 2 and 3): one safetensors file, no pickle anywhere.

Layout (schema in ``docs/bundle-format.md``): the safetensors header's
``__metadata__`` is ``{"dcsched-bundle": "3"}`` (the version; ``"2"`` for a
file without plans, still read); the tensors are

``bundle.json``            uint8: the UTF-8 JSON document (params, inputs, placeholder tables,
                           provenance, constant names, each graph's tables of distinct values;
                           version 3 adds each graph's communication plan and the step's residency,
                           :mod:`dcsched.bundle.plans`)
``graph.<name>.<column>``  each graph's node columns (:mod:`dcsched.bundle.columns`)
``constant.<name>``        the constants ``get_attr`` nodes read
``input.<k>``              the stored value of step input ``k``

Reading parses the safetensors header (Rust) and the JSON (C), then checks
everything before anything is built; no stored name or value is executed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dcsched import safeparse
from dcsched.bundle import checks as loadchecks
from dcsched.bundle import optimizer, saved_memory
from dcsched.bundle.columns import GraphColumns, one_thread
from dcsched.bundle.plans import plans_document, read_plans
from dcsched.graph.form import paused_gc
from dcsched.errors import BundleError

#: The version written. Version 3 adds the communication plans to version 2's document; both are read.
VERSION = 3
#: The safetensors versions read: 2 (no plans: it loads with none) and 3.
READ_VERSIONS = (2, 3)
#: The safetensors metadata key that marks a bundle; its value is the version (``"3"``).
MAGIC_KEY = "dcsched-bundle"
DOC = "bundle.json"
GRAPH_NAMES = ("forward", "backward")
#: Largest safetensors header read (the format's own parser allows 100 MB).
MAX_HEADER = 100_000_000


def is_v2(head: bytes) -> bool:
    """Whether a file beginning with ``head`` (9 bytes or more) is a safetensors file (a version-2 bundle)."""
    if len(head) < 9 or head[8:9] != b"{":
        return False
    return 2 <= int.from_bytes(head[:8], "little") <= MAX_HEADER


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def document_and_tensors(bundle) -> tuple[dict, dict[str, torch.Tensor]]:
    """The JSON document and the tensors of ``bundle``'s file."""
    tensors: dict[str, torch.Tensor] = {}
    graphs = {}
    for name in bundle.graph_names:
        columns = bundle.columns(name).in_first_use_order()  # a reordered graph's as encoding it afresh gives
        graphs[name] = columns.tables()
        tensors.update(columns.tensors(f"graph.{name}."))
    inputs = []
    for k, i in enumerate(bundle.inputs):
        if i.value is not None:
            tensors[f"input.{k}"] = i.value
        inputs.append({"name": i.name, "shape": list(i.shape), "dtype": _dtype_name(i.dtype),
                       "value": i.value is not None, "low": i.low, "high": i.high})
    for name, value in bundle.constants.items():
        tensors[f"constant.{name}"] = value
    doc = {
        "format": "dcsched-bundle",
        "version": VERSION,
        "graphs": graphs,
        "params": [{"name": p.name, "shape": list(p.shape), "dtype": _dtype_name(p.dtype), "ds_id": p.ds_id}
                   for p in bundle.params],
        "inputs": inputs,
        "forward_placeholders": [dict(p) for p in bundle.forward_placeholders],
        "backward_placeholders": [dict(p) for p in bundle.backward_placeholders],
        "num_user_outputs": bundle.num_user_outputs,
        "constants": list(bundle.constants),
        "provenance": dict(bundle.provenance),
    }
    with one_thread(), paused_gc():
        doc.update(plans_document(bundle))
    return doc, tensors


def encode(doc: dict, tensors: dict[str, torch.Tensor], version: int = VERSION) -> bytes:
    """The file's bytes: ``doc`` as JSON in ``bundle.json`` beside ``tensors``, the header saying ``version``
    (no check: tests write hostile and older files through this)."""
    from safetensors.torch import save as st_save
    try:
        text = json.dumps(doc, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    except ValueError as exc:
        raise ValueError(f"the bundle holds a value JSON cannot store ({exc})") from None
    blob = text.encode("utf-8")
    stored = {DOC: torch.frombuffer(bytearray(blob), dtype=torch.uint8)}
    for key, tensor in tensors.items():
        stored[key] = tensor.detach().to("cpu").contiguous().clone()
    # One metadata key: safetensors writes the metadata map in no fixed order, and a bundle's bytes are fixed.
    return st_save(stored, metadata={MAGIC_KEY: str(version)})


def write(bundle, path: Path, *, overwrite: bool = True) -> None:
    from dcsched.outputs import write_atomic
    try:
        data = encode(*document_and_tensors(bundle))
    except (ValueError, TypeError) as exc:
        raise BundleError(path, f"cannot be stored: {exc}") from None
    write_atomic(path, lambda handle: handle.write(data), overwrite=overwrite)


def read_raw(path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """The JSON document and tensors of a version-2 file, parsed but unchecked (BundleError if unreadable)."""
    from safetensors import SafetensorError
    from safetensors.torch import load as st_load
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise BundleError(path, f"cannot be read ({exc.strerror or type(exc).__name__})") from None
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError, RuntimeError, OverflowError, TypeError):
        raise BundleError(path, "file is truncated or corrupt (not a readable safetensors file)") from None
    except Exception:  # any other parse failure of foreign bytes; nothing was executed
        raise BundleError(path, "file is truncated or corrupt (not a readable safetensors file)") from None
    metadata = _metadata(data)
    if MAGIC_KEY not in metadata:
        raise BundleError(path, "not a dcsched graph bundle (a safetensors file without the 'dcsched-bundle' "
                                "header)")
    version = _check_version(metadata[MAGIC_KEY], path)
    blob = tensors.pop(DOC, None)
    if blob is None or blob.dtype != torch.uint8 or blob.dim() != 1:
        raise BundleError(path, f"not a dcsched graph bundle (no '{DOC}' document)")
    try:
        doc = safeparse.loads(bytes(blob.numpy()), what="its JSON document")
    except ValueError as exc:
        if "not valid JSON" in str(exc) or "not UTF-8" in str(exc):
            raise BundleError(path, "file is truncated or corrupt (its JSON document does not parse)") from None
        raise BundleError(path, str(exc)) from None  # nested too deep, too large
    if isinstance(doc, dict) and doc.get("version") != version and doc.get("version") in READ_VERSIONS:
        # Each version reads its own keys: a document must not be taken for another version's.
        raise BundleError(path, f"not a dcsched graph bundle (its document says version {doc['version']}, its "
                                f"header {version})")
    return doc, tensors


def _metadata(data: bytes) -> dict:
    size = int.from_bytes(data[:8], "little")
    try:
        header = safeparse.loads(data[8:8 + size], what="the safetensors header", max_bytes=MAX_HEADER)
    except ValueError:
        return {}
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def _check_version(text: Any, path) -> int:
    """The header's version (ASCII digits: ``"3"``, not ``"03"``, ``"３"`` or ``"²"``), one this reader reads
    (BundleError otherwise)."""
    if not isinstance(text, str):  # safetensors metadata holds strings only
        raise BundleError(path, f"bundle version {text!r:.40} is not a version number (ASCII digits, 1 or more)")
    try:
        version = safeparse.parse_version(text, what="bundle version")
    except ValueError as exc:
        raise BundleError(path, str(exc)) from None
    if version > VERSION:
        raise BundleError(path, f"bundle version {version} was written by a newer dcsched "
                                f"(this one reads up to version {VERSION}); upgrade dcsched")
    if version not in READ_VERSIONS:
        raise BundleError(path, f"bundle version {version} is not stored as a safetensors file")
    return version


def read(path: Path):
    """Read and check a version-2 bundle (BundleError with the reason)."""
    doc, tensors = read_raw(path)
    try:
        return from_parts(doc, tensors)
    except BundleError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, IndexError) as exc:
        detail = str(exc) if not isinstance(exc, KeyError) else f"missing field {exc}"
        raise BundleError(path, detail) from None


def from_parts(doc: Any, tensors: dict[str, torch.Tensor]):
    """A checked :class:`~dcsched.bundle.core.Bundle` from a file's document and tensors (ValueError).

    A version-2 document loads with no plans; a version-3 one with its plans, checked
    (:func:`dcsched.bundle.plans.read_plans`).
    """
    from dcsched.bundle import core
    if not isinstance(doc, dict) or doc.get("format") != "dcsched-bundle" or type(doc.get("version")) is not int \
            or doc["version"] not in READ_VERSIONS:
        raise ValueError("not a dcsched graph bundle (its document lacks the 'dcsched-bundle' version 2 or 3 "
                         "header)")
    # Nesting and size limits per entry: a table grows with the model (a placeholder per parameter), an entry
    # does not. The graphs' templates and meta entries are checked one by one (GraphColumns.check).
    loadchecks.check_arguments(doc.get("provenance"), "the bundle's provenance")
    for part in ("forward_placeholders", "backward_placeholders", "inputs", "params", "constants"):
        entries = doc.get(part, [])
        if not isinstance(entries, list):
            raise ValueError(f"the bundle's {part} is not a list")
        for entry in entries:
            loadchecks.check_arguments(entry, f"the bundle's {part}")
    names = doc.get("constants", [])
    if not isinstance(names, list):
        raise ValueError("the constants table is not a list of names")
    constants = {}
    for name in names:
        loadchecks.check_constant_name(name)
        if f"constant.{name}" not in tensors:
            raise ValueError(f"constant {name!r} has no tensor")
        constants[name] = tensors[f"constant.{name}"]
    constants = core._constants(constants)
    graphs = doc["graphs"]
    if not isinstance(graphs, dict) or "forward" not in graphs:
        raise ValueError("bundle has no forward graph")
    params = core.params_table(doc["params"])
    ds_ids = {p.ds_id for p in params}
    stored = {}
    for name, tables in graphs.items():
        if name not in GRAPH_NAMES:
            raise ValueError(f"graph {name!r:.40} is neither 'forward' nor 'backward'")
        columns = GraphColumns.from_parts(tables, tensors, f"graph.{name}.", f"graph '{name}'")
        stored[name] = columns
    loadchecks.check_graph_ids({name: columns.graph_id for name, columns in stored.items()})
    for name, columns in stored.items():
        with one_thread():
            columns.check(name, set(constants), ds_ids=ds_ids)
    inputs = []
    for k, entry in enumerate(doc.get("inputs", [])):
        if not isinstance(entry, dict):
            raise ValueError(f"input {k} is not a table")
        entry = dict(entry)
        flag = entry.get("value")
        if flag is True:
            entry["value"] = tensors.get(f"input.{k}")
            if entry["value"] is None:
                raise ValueError(f"input {entry.get('name')!r}: its stored value is missing")
        elif flag not in (False, None):
            raise ValueError(f"input {entry.get('name')!r}: its stored value is a {type(flag).__name__}, "
                             "not a tensor")
        else:
            entry["value"] = None
        inputs.append(core._input(entry))
    provenance = doc.get("provenance", {})
    if not isinstance(provenance, dict):
        raise ValueError("the bundle's provenance is not a table")
    saved_memory.from_provenance(provenance)  # its byte counts in bounds (a ValueError names the figure)
    optimizer.from_provenance(provenance)  # an optimizer record in bounds
    num_user_outputs = doc.get("num_user_outputs", 1)
    if isinstance(num_user_outputs, bool) or not isinstance(num_user_outputs, int) or num_user_outputs < 0:
        raise ValueError(f"num_user_outputs {num_user_outputs!r} is not a count")
    bundle = core.Bundle(
        forward=stored["forward"], backward=stored.get("backward"), params=params, inputs=inputs,
        forward_placeholders=list(doc.get("forward_placeholders", [])),
        backward_placeholders=list(doc.get("backward_placeholders", [])),
        num_user_outputs=num_user_outputs,
        graph_ids={name: columns.graph_id for name, columns in stored.items()},
        constants=constants, provenance=dict(provenance))
    if doc["version"] >= 3:
        with one_thread(), paused_gc():  # 10^4 buckets of small objects beside 10^6 names: no full collections
            bundle.plans = read_plans(doc, stored, {p.ds_id for p in params})
    return bundle
