"""A checkpoint's non-tensor items (step counters, optimizer hyperparameters) as plain data, read without running code.

``torch.distributed.checkpoint`` stores every state-dict value that is not a
tensor as a byte item, a ``torch.save`` archive that it reads back with
``torch.load(weights_only=False)``: any pickle planted there runs.
:func:`decode_object` reads byte items without that risk, building plain data
only (``None``, bools, ints, floats, strings, lists, tuples, dicts with string
keys):

- a ``torch.save`` archive (what DCP and FSDP2 write, and what
  :func:`encode_item` writes, so that torch's own readers read a dcsched
  checkpoint) is read by an unpickler that knows no class at all: the opcodes
  that build plain data need none, so a pickle that names any callable
  (``os.system``) stops there;
- dcsched's JSON item (:func:`encode_object`), which also carries small
  tensors held inside plain data (an ``lr`` given as a tensor), which a pickle
  could only carry through torch's classes. JSON has no tuples or tensors, so
  they are tagged, as dicts are, to keep the three apart::

    {"dcsched_object": 1, "value": {"dict": {"lr": 0.01, "betas": {"tuple": [0.9, 0.999]}}}}

Any other byte stream (a bare pickle, the pre-zip ``torch.save`` format) is
refused.

>>> decode_object(encode_object({"step": 3, "betas": (0.9, 0.999), "fused": None}), what="extra")
{'step': 3, 'betas': (0.9, 0.999), 'fused': None}
>>> decode_object(b"\\x80\\x04\\x95...", what="extra.step")
Traceback (most recent call last):
...
ValueError: extra.step is not an item dcsched writes (neither its JSON nor a torch.save archive)
"""

from __future__ import annotations

import io
import json
import math
import pickle
import zipfile
from typing import Any

import torch

from dcsched.safeparse import json_depth, loads

#: The version of the JSON item format.
FORMAT = 1
#: Largest byte item read (dcsched's are a few KB: hyperparameters, counters).
MAX_ITEM_BYTES = 64 << 20
#: Most elements of a tensor held inside a non-tensor item (larger ones belong in an item of their own).
MAX_INNER_TENSOR = 1 << 16
#: Deepest nesting of Python containers an item holds (its JSON, tagged, is about twice as deep).
MAX_DEPTH = 24
_ZIP_MAGIC = b"PK\x03\x04"
_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


def _encode(value: Any, depth: int, where: str) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"{where} nests deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, list):
        return [_encode(item, depth + 1, where) for item in value]
    if isinstance(value, tuple):
        return {"tuple": [_encode(item, depth + 1, where) for item in value]}
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise ValueError(f"{where} is a dict whose keys are not all strings")
        return {"dict": {key: _encode(item, depth + 1, f"{where}[{key!r}]") for key, item in value.items()}}
    if isinstance(value, torch.Tensor) and not value.is_complex():
        name = str(value.dtype).removeprefix("torch.")
        if name not in _DTYPES or value.numel() > MAX_INNER_TENSOR:
            raise ValueError(f"{where} holds a {name} tensor of {value.numel()} elements inside other data "
                             f"(at most {MAX_INNER_TENSOR} elements of a real dtype; pass it as an item)")
        flat = value.detach().to("cpu").reshape(-1).tolist()
        return {"tensor": {"dtype": name, "shape": list(value.shape), "values": flat}}
    raise ValueError(f"{where} is a {type(value).__name__}: a checkpoint holds tensors and plain data "
                     "(None, bool, int, float, str, and lists, tuples, string-keyed dicts of them)")


def encode_object(value: Any, what: str = "the value") -> bytes:
    """``value`` as the JSON byte item :func:`decode_object` reads; ValueError naming ``what`` when it is not
    plain data (see the module docstring).

    >>> encode_object((1, None))
    b'{"dcsched_object": 1, "value": {"tuple": [1, null]}}'
    """
    document = {"dcsched_object": FORMAT, "value": _encode(value, 0, what)}
    return json.dumps(document, allow_nan=True).encode("utf-8")


def _tensor(record: Any, what: str) -> torch.Tensor:
    if not isinstance(record, dict) or set(record) != {"dtype", "shape", "values"}:
        raise ValueError(f"{what} holds a malformed tensor record")
    dtype, shape, values = _DTYPES.get(record["dtype"]), record["shape"], record["values"]
    if (dtype is None or not isinstance(shape, list) or not isinstance(values, list)
            or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n for n in shape)
            or len(values) > MAX_INNER_TENSOR or math.prod(shape) != len(values)
            or not all(isinstance(v, (bool, int, float)) for v in values)):
        raise ValueError(f"{what} holds a malformed tensor record")
    return torch.tensor(values, dtype=dtype).reshape(shape)


def _decode(node: Any, what: str) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_decode(item, what) for item in node]
    if isinstance(node, dict) and len(node) == 1:
        (tag, body), = node.items()
        if tag == "tuple" and isinstance(body, list):
            return tuple(_decode(item, what) for item in body)
        if tag == "dict" and isinstance(body, dict):
            return {key: _decode(item, what) for key, item in body.items()}
        if tag == "tensor":
            return _tensor(body, what)
    raise ValueError(f"{what} holds an object that is not a tagged tuple, dict or tensor")


class _PlainUnpickler(pickle.Unpickler):
    """Builds what pickle's own opcodes build (None, bools, numbers, strings, lists, tuples, dicts) and nothing
    that needs a class or a function, so no pickle read through it can call one."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it names {module}.{name}, and a checkpoint item is plain data")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a tensor inside an object, which dcsched reads only as an item")


def _check_plain(value: Any, depth: int = 0) -> None:
    """Plain data, no deeper than MAX_DEPTH (a pickle can build a list that holds itself)."""
    if depth > MAX_DEPTH:
        raise pickle.UnpicklingError(f"it nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_plain(item, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, depth + 1)
            _check_plain(item, depth + 1)
    elif not (value is None or isinstance(value, (bool, int, float, str, bytes))):
        raise pickle.UnpicklingError(f"it holds a {type(value).__name__}")


def _data_pickle(data: bytes) -> bytes:
    """The ``data.pkl`` of a ``torch.save`` archive, as ``torch.distributed.checkpoint`` writes byte items."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        pickles = [info for info in archive.infolist() if info.filename.endswith("/data.pkl")]
        if len(pickles) != 1 or pickles[0].file_size > MAX_ITEM_BYTES:
            raise pickle.UnpicklingError(f"a torch.save archive without one data.pkl of at most {MAX_ITEM_BYTES} "
                                         "bytes")
        with archive.open(pickles[0]) as stream:
            return stream.read(MAX_ITEM_BYTES + 1)


def _legacy(data: bytes, what: str) -> Any:
    """The plain data an older checkpoint's ``torch.save`` archive holds, unpickled without any class."""
    try:
        value = _PlainUnpickler(io.BytesIO(_data_pickle(data))).load()
        _check_plain(value)
        return value
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, TypeError, AttributeError, IndexError,
            KeyError, ValueError, RecursionError, MemoryError, UnicodeDecodeError) as error:
        raise ValueError(f"{what} is not plain data ({str(error)[:120] or type(error).__name__})") from None


def decode_object(data: bytes, what: str) -> Any:
    """The value a byte item holds: dcsched's JSON, or an older checkpoint's plain-data ``torch.save``
    archive; ValueError naming ``what`` for anything else (no pickle opcode here calls a function)."""
    if len(data) > MAX_ITEM_BYTES:
        raise ValueError(f"{what} is {len(data)} bytes, over the largest item read ({MAX_ITEM_BYTES})")
    if data.startswith(_ZIP_MAGIC):
        return _legacy(data, what)
    if not data.lstrip().startswith(b"{"):
        raise ValueError(f"{what} is not an item dcsched writes (neither its JSON nor a torch.save archive)")
    document = loads(data, what=what, max_depth=2 * MAX_DEPTH + 4)
    if not isinstance(document, dict) or set(document) != {"dcsched_object", "value"}:
        raise ValueError(f"{what} is JSON but not a dcsched item")
    if document["dcsched_object"] != FORMAT:
        raise ValueError(f"{what} is a dcsched item of format {str(document['dcsched_object'])[:20]!r}; "
                         f"this dcsched reads format {FORMAT}")
    return _decode(document["value"], what)


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_tensor(item) for item in value.values())
    return isinstance(value, torch.Tensor)


def encode_item(value: Any, what: str = "the value") -> bytes:
    """The byte item dcsched writes for the plain data ``value``: a ``torch.save`` archive that names no class
    (read by torch's readers and :func:`decode_object` alike), or where that cannot be (a tensor inside, a
    ``str`` subclass) :func:`encode_object`'s JSON. ValueError naming ``what`` when ``value`` is not plain data.

    >>> item = encode_item({"betas": (0.9, 0.999), "fused": None}, "group")
    >>> item[:4], decode_object(item, what="group")
    (b'PK\\x03\\x04', {'betas': (0.9, 0.999), 'fused': None})
    >>> encode_item({"lr": torch.tensor(0.5)})[:18]
    b'{"dcsched_object":'
    """
    document = encode_object(value, what)
    if _holds_tensor(value):
        return document
    stream = io.BytesIO()
    torch.save(value, stream)
    archive = stream.getvalue()
    try:
        decode_object(archive, what)  # plain pickle opcodes only: no class named
    except ValueError:
        return document
    return archive


def check_encodable(value: Any, what: str) -> None:
    """ValueError naming ``what`` unless :func:`decode_object` reads back what :func:`encode_object` writes
    for ``value`` (plain data, not too deep)."""
    encoded = encode_object(value, what)
    if json_depth(encoded.decode("utf-8")) > 2 * MAX_DEPTH + 4:
        raise ValueError(f"{what} nests too deep to be read back")
