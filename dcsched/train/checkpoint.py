"""Checkpoints of a (sharded) module and its optimizer through ``torch.distributed.checkpoint`` (DCP).

:func:`save_checkpoint` writes one DCP checkpoint directory; every rank calls
it, each writing its own shards. Its state dict is the one FSDP2 users save
(``{"model": ..., "optim": ...}`` of ``get_state_dict``, flattened by DCP):

- ``model.<name>``: each parameter and buffer in its full shape. A parameter
  :func:`dcsched.shard` sharded is stored as the rectangular blocks of its
  full shape that the rank's range of the flattened parameter makes up, each
  at its offset (:mod:`dcsched.train.checkpoint_layout`): chunks of a
  full-shape tensor, as DCP stores FSDP2's ``Shard(0)`` DTensors, without the
  padding and independent of the world size. Buffers (BatchNorm statistics),
  frozen, unsharded and replicated parameters (``replicate_below``) are
  stored whole, written once; a tied parameter under each of its names;
- ``optim.state.<name>.<key>``: the optimizer state of each parameter
  (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``), a tensor of the shard's
  shape stored like its parameter, anything else whole;
- ``optim.param_groups.<group>.<setting>``: each hyperparameter of each
  group, and ``params``, the group's parameters by name;
- ``extra.<key>``: whatever the caller passes as ``extra`` (a step counter,
  a data generator's state): tensors, or plain data.

So torch's own tools read it (``dcp_to_torch_save`` gives a plain state dict
whose ``model.`` part loads into the unsharded model), FSDP2 resumes from it,
and :func:`load_checkpoint` resumes from FSDP2's. It also reads the earlier
layout, which stored a sharded parameter flattened (shape ``(numel,)``) and
the groups as one ``optim.param_groups`` item.

Values that are not tensors (the groups, ``extra``'s counters) are stored as
``torch.save`` archives that name no class (or dcsched's JSON where those
cannot hold them: :mod:`dcsched.train.checkpoint_objects`); reading a
checkpoint runs nothing from it and opens nothing outside its directory
(:mod:`dcsched.train.checkpoint_files`).

The schedule is not part of the state: a checkpoint resumes under any
algorithm. A module that was never sharded (a plain run) saves its ordinary
state dict the same way; either loads into a sharded or an unsharded module.

:func:`load_checkpoint` reads one back in place into a model and optimizer
built as before (same module, ``dcsched.shard`` called, optimizer built, no
step taken needed). A missing, incomplete or corrupt checkpoint, or one of
another model, raises :class:`CheckpointError` with one line.

>>> import tempfile, torch
>>> model = torch.nn.Linear(3, 2)
>>> optimizer = torch.optim.AdamW(model.parameters())
>>> model(torch.ones(1, 3)).sum().backward(); optimizer.step()
>>> path = tempfile.mkdtemp() + "/ckpt"
>>> save_checkpoint(path, model, optimizer, extra={"step": 1})
>>> fresh = torch.nn.Linear(3, 2); fresh_optimizer = torch.optim.AdamW(fresh.parameters())
>>> load_checkpoint(path, fresh, fresh_optimizer)
{'step': 1}
>>> torch.equal(fresh.weight, model.weight), float(fresh_optimizer.state[fresh.weight]["step"])
(True, 1.0)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from dcsched.errors import DcschedError
from dcsched.train.checkpoint_files import (CheckpointError, SafeLoadPlanner, SafeReader, check_storage,
                                            verify_checksums, write_checksums)
from dcsched.train.checkpoint_layout import FlatPieces
from dcsched.train.checkpoint_objects import check_encodable
from dcsched.train.checkpoint_writer import PlainSavePlanner, SafeWriter
from dcsched.train.full_state import local_state_dict
from dcsched.train.sharding import Sharding, sharding_of

MODEL, STATE, GROUPS, EXTRA = "model.", "optim.state.", "optim.param_groups", "extra."

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]


def _size(stored) -> tuple[int, ...] | None:
    """A checkpoint item's full shape; None for an object."""
    size = getattr(stored, "size", None)
    return tuple(size) if size is not None else None


def _unwrap(model: nn.Module) -> nn.Module:
    """The module itself when given what ``torch.compile`` returned (an OptimizedModule)."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model


def _distributed() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


class _Layout:
    """How one module's (and its optimizer's) tensors map to checkpoint keys and stored tensors."""

    def __init__(self, model: nn.Module) -> None:
        self.module = _unwrap(model)
        if not isinstance(self.module, nn.Module):
            raise CheckpointError(f"a checkpoint takes an nn.Module, not {type(model).__name__}")
        self.sharding: Sharding | None = sharding_of(self.module)
        specs = self.sharding.specs if self.sharding is not None else []
        self.spec_of = {id(spec.param): spec for spec in specs}
        self.name_of: dict[int, str] = {}
        for name, param in self.module.named_parameters():  # a tied parameter under its first name
            self.name_of.setdefault(id(param), name)
        self.aliases = {name for name, param in self.module.named_parameters(remove_duplicate=False)
                        if id(param) in self.spec_of}
        self.mesh = None
        if self.sharding is not None and _distributed():
            from torch.distributed.device_mesh import DeviceMesh
            import torch.distributed as dist
            group = self.sharding.group or dist.group.WORLD
            self.mesh = DeviceMesh.from_group(group, specs[0].param.device.type)

    def stored(self, local: torch.Tensor, spec, flat: bool = False) -> torch.Tensor:
        """What the checkpoint holds for a padded 1-D shard ``local`` of ``spec``'s parameter: this rank's range
        of the full-shape tensor as blocks at their offsets (the whole parameter, plain, for a replicated one);
        ``flat``: the flattened parameter's range instead, the layout of checkpoints written before."""
        if spec.replicated:
            whole = local.detach()[:spec.numel]
            return whole if flat else whole.view(spec.shape)
        chunk = local.numel()
        rank = self.sharding.rank if self.sharding is not None else 0
        start = min(rank * chunk, spec.numel)
        part = local.detach()[:max(0, min(chunk, spec.numel - start))]
        if not flat:
            return FlatPieces(part, start, spec.shape)
        if self.mesh is None:
            return part
        from torch.distributed.tensor import DTensor, Shard
        return DTensor.from_local(part, self.mesh, [Shard(0)], run_check=False, shape=torch.Size([spec.numel]),
                                  stride=(1,))

    def model_state(self, flat: frozenset[str] = frozenset(), tied=None) -> dict:
        """The model's checkpoint items; the parameters named in ``flat`` in the earlier, flattened layout; the
        second names of tied parameters only those in ``tied`` when given (the earlier layout has none)."""
        with local_state_dict():  # the shards as they are: each rank stores its own
            state = {MODEL + name: value for name, value in self.module.state_dict().items()
                     if name not in self.aliases}
        for spec in self.spec_of.values():
            state[MODEL + spec.name] = self.stored(spec.param, spec, flat=spec.name in flat)
        for name, param in self.module.named_parameters(remove_duplicate=False):
            first = self.spec_of[id(param)].name if id(param) in self.spec_of else name
            if name != first and (tied is None or MODEL + name in tied):
                state[MODEL + name] = state[MODEL + first]  # a tied parameter under each name, as torch's
        return state

    def flat_in(self, metadata: dict) -> frozenset[str]:
        """The sharded parameters ``metadata`` stores flattened (``(numel,)``, not their shape): a checkpoint
        of the earlier layout."""
        return frozenset(spec.name for spec in self.spec_of.values()
                         if len(spec.shape) != 1 and _size(metadata.get(MODEL + spec.name)) == (spec.numel,))

    def param_name(self, param) -> str:
        name = self.name_of.get(id(param))
        if name is None:
            raise CheckpointError("the optimizer holds a parameter that is not the model's: pass the model "
                                  "the optimizer was built for")
        return name

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        state: dict = {}
        for index, group in enumerate(optimizer.param_groups):  # one item per setting, as DCP flattens them
            for key, value in group.items():
                state[f"{GROUPS}.{index}.{key}"] = value if key != "params" else \
                    [self.param_name(p) for p in group["params"]]
            for param in group["params"]:
                spec = self.spec_of.get(id(param))
                for key, value in optimizer.state.get(param, {}).items():
                    sharded = spec is not None and isinstance(value, torch.Tensor) and value.shape == param.shape
                    state[f"{STATE}{self.param_name(param)}.{key}"] = self.stored(value, spec) if sharded else value
        return state


@contextlib.contextmanager
def _quiet():
    """DCP warns that it assumes one process when there is no process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _failures() -> tuple:
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
    return (Exception, CheckpointException)


def _partial(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def _on_rank0(path: Path, action) -> None:
    """Run ``action`` on rank 0 alone; every rank raises its OSError (a broadcast: no rank waits forever)."""
    import torch.distributed as dist
    problem = None
    if not _distributed() or dist.get_rank() == 0:
        try:
            action()
        except OSError as error:
            problem = _write_failed(path, error)
    if _distributed():
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise CheckpointError(problem)


def _check_target(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path}: exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / ".metadata").is_file():
        raise CheckpointError(f"{path}: a non-empty directory that is not a checkpoint; refusing to replace it")
    parent = next((p for p in path.parents if p.exists()), Path("."))
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise CheckpointError(f"{path}: {parent} is not a writable directory")


def save_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict | None = None) -> None:
    """Write ``model``'s (and ``optimizer``'s) state to the DCP checkpoint directory ``path``; every rank calls it.

    The checkpoint is written beside ``path`` and renamed into place once
    complete, replacing an earlier checkpoint there.

    Parameters
    ----------
    path : str or os.PathLike
        The checkpoint directory (``torch.distributed.checkpoint`` layout).
    model : torch.nn.Module
        A module sharded with :func:`dcsched.shard` (each rank writes the
        blocks of the full-shape tensors its shards hold) or a plain one.
    optimizer : torch.optim.Optimizer, optional
        Its state is saved sharded alike.
    extra : dict, optional
        Values that :func:`load_checkpoint` returns: tensors, or plain data
        (``None``, bools, ints, floats, strings, and lists, tuples and
        string-keyed dicts of them, small tensors included).

    Raises
    ------
    CheckpointError
        ``path`` cannot be written (a full disk: the OS's reason; the partial
        directory is removed and an earlier checkpoint there stays), a value
        is not plain data (before anything is written), or the ranks disagree
        on what they save.

    Examples
    --------
    >>> import tempfile, torch
    >>> model = torch.nn.Linear(2, 2)
    >>> with tempfile.TemporaryDirectory() as d:
    ...     save_checkpoint(f"{d}/ckpt", model, extra={"step": 3})
    ...     load_checkpoint(f"{d}/ckpt", torch.nn.Linear(2, 2))["step"]
    3
    """
    import torch.distributed.checkpoint as dcp
    path = Path(path)
    _check_target(path)
    layout = _Layout(model)
    state = layout.model_state()
    if optimizer is not None:
        state.update(layout.optimizer_state(optimizer))
    state.update({EXTRA + key: value for key, value in (extra or {}).items()})
    _check_plain(path, state)
    partial = _partial(path)

    def prepare():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)

    _on_rank0(path, prepare)
    try:
        with _quiet():  # one key per value: the state is flattened here, as DCP flattens it
            dcp.save(state, storage_writer=SafeWriter(str(partial)), planner=PlainSavePlanner())
    except _failures() as error:  # DCP wraps every rank's failure
        _on_rank0(path, lambda: shutil.rmtree(partial, ignore_errors=True))
        raise CheckpointError(_write_failed(path, error)) from None
    _on_rank0(path, lambda: _publish(partial, path))


def _write_failed(path: Path, error: BaseException) -> str:
    return f"{path}: cannot write the checkpoint ({_first_line(error)}); an earlier checkpoint there is unchanged"


def _check_plain(path: Path, state: dict) -> None:
    """CheckpointError before anything is written when a non-tensor value is not plain data."""
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            try:
                check_encodable(value, key)
            except ValueError as error:
                raise CheckpointError(f"{path}: cannot save {error}") from None


def _publish(partial: Path, path: Path) -> None:
    """Checksum the complete checkpoint ``partial`` and put it in place of ``path`` (rank 0); on an OSError
    the partial directory goes and the earlier checkpoint stays where it was."""
    old = path.parent / f".{path.name}.old"
    moved = False
    try:
        write_checksums(partial)
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
            moved = True
        partial.rename(path)
    except OSError:
        if moved and not path.exists():
            old.rename(path)
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _first_line(error: BaseException) -> str:
    """One line for ``error``; DCP's CheckpointException (a BaseException) names the first failed rank's error."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (cause, _trace) = min(failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {_first_line(cause)}"
    if isinstance(error, OSError) and error.strerror:  # the OS's words: "no space left on device (__0_0.distcp)"
        where = f" ({Path(error.filename).name})" if isinstance(error.filename, (str, os.PathLike)) else ""
        return f"{error.strerror[:1].lower()}{error.strerror[1:]}{where}"
    if isinstance(error, DcschedError):  # already one line saying what is wrong
        return str(error)
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _metadata(path: Path):
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path}: not a checkpoint (no .metadata: missing, or the save did not finish)")
    try:  # never plain pickle: a planted .metadata would run code here
        return SafeReader(str(path)).read_metadata()
    except Exception as error:  # noqa: BLE001 - a corrupt metadata file: any unpickling error
        raise CheckpointError(f"{path}: corrupt checkpoint metadata ({_first_line(error)})") from None


def _check_model_keys(path: Path, state: dict, metadata: dict) -> None:
    for key, value in state.items():
        stored = metadata.get(key)
        if stored is None or not hasattr(stored, "size"):
            raise CheckpointError(f"{path}: the checkpoint has no tensor for {key[len(MODEL):]!r} (another model?)")
        if tuple(stored.size) != tuple(value.shape):
            raise CheckpointError(f"{path}: {key[len(MODEL):]!r} is {tuple(stored.size)} in the checkpoint, "
                                  f"{tuple(value.shape)} here (another model, or a flattened checkpoint of the "
                                  "earlier layout in an unsharded one?)")


def _destination(layout: _Layout, metadata: dict, key: str, param, buffers: dict):
    """A tensor to load ``key`` into (the padded buffer kept in ``buffers``), or a placeholder for an object."""
    stored = metadata[key]
    if not hasattr(stored, "size"):
        return None
    dtype = stored.properties.dtype
    spec = layout.spec_of.get(id(param)) if param is not None else None
    size = tuple(stored.size)
    if spec is not None and size and size in {(spec.numel,), spec.shape}:  # the shard's state: this rank's range
        buffers[key] = torch.zeros(param.shape, dtype=dtype, device=param.device)
        return layout.stored(buffers[key], spec, flat=size != spec.shape)
    device = param.device if param is not None else "cpu"
    buffers[key] = torch.zeros(tuple(stored.size), dtype=dtype, device=device)
    return buffers[key]


def load_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer``) in place; returns its ``extra``.

    Every rank calls it; each reads the shards it holds (any world size the
    checkpoint was written with).

    Parameters
    ----------
    path : str or os.PathLike
        A directory :func:`save_checkpoint` wrote, or FSDP2's ``dcp.save`` of
        ``{"model": ..., "optim": ...}`` (``get_state_dict``; an
        ``"extra"`` dict there is returned).
    model : torch.nn.Module
        The same architecture, sharded with :func:`dcsched.shard` or not.
    optimizer : torch.optim.Optimizer, optional
        Receives the saved optimizer state.

    Returns
    -------
    dict
        The ``extra`` values given to :func:`save_checkpoint`.

    Raises
    ------
    CheckpointError
        No checkpoint at ``path``, a damaged one (checksums), one whose files
        lie outside it or are not regular files, an item that is not plain
        data or a tensor, names or shapes that differ from ``model``'s, or no
        optimizer state when asked for.

    Examples
    --------
    See :func:`save_checkpoint`.
    """
    import torch.distributed.checkpoint as dcp
    path = Path(path)
    whole = _metadata(path)
    verify_checksums(path, {".metadata", *check_storage(path, whole)})
    metadata = whole.state_dict_metadata
    layout = _Layout(model)
    state = layout.model_state(flat=layout.flat_in(metadata), tied=metadata)
    _check_model_keys(path, state, metadata)
    buffers: dict = {}
    params = {layout.name_of[id(p)]: p for p in layout.module.parameters()}
    if optimizer is not None:
        if not any(key == GROUPS or key.startswith(GROUPS + ".") for key in metadata):
            raise CheckpointError(f"{path}: the checkpoint holds no optimizer state")
        for key in metadata:
            if key == GROUPS or key.startswith(GROUPS + "."):
                state[key] = None  # an object: its setting, or (a checkpoint of the earlier layout) every group
            elif key.startswith(STATE):
                name = key[len(STATE):].rpartition(".")[0]
                if name not in params:
                    raise CheckpointError(f"{path}: optimizer state for {name!r}, which this model lacks")
                state[key] = _destination(layout, metadata, key, params[name], buffers)
    for key in metadata:
        if key.startswith(EXTRA):
            state[key] = _destination(layout, metadata, key, None, buffers)
    try:
        with _quiet():
            dcp.load(state, checkpoint_id=str(path), storage_reader=SafeReader(str(path)),
                     planner=SafeLoadPlanner())
    except _failures() as error:  # a truncated or corrupt data file
        raise CheckpointError(f"{path}: cannot read the checkpoint: {_first_line(error)}") from None
    if optimizer is not None:
        _load_optimizer(path, layout, optimizer, state, buffers)
    return {key[len(EXTRA):]: buffers.get(key, state[key]) for key in state if key.startswith(EXTRA)}


def _saved_groups(path: Path, state: dict) -> list:
    """The optimizer's parameter groups the checkpoint holds: one item per setting
    (``optim.param_groups.<group>.<setting>``, as DCP flattens a torch optimizer state dict), or all groups in
    one item (the earlier layout)."""
    if GROUPS in state:
        saved = state[GROUPS]
        if not isinstance(saved, list) or not all(isinstance(group, dict) for group in saved):
            raise CheckpointError(f"{path}: {GROUPS} is not a list of parameter groups")
        return saved
    groups: dict[int, dict] = {}
    for key, value in state.items():
        if key.startswith(GROUPS + "."):
            index, _, setting = key[len(GROUPS) + 1:].partition(".")
            if not (index.isascii() and index.isdigit() and len(index) < 7) or not setting:
                raise CheckpointError(f"{path}: {key[:120]!r} names no parameter group and setting")
            groups.setdefault(int(index), {})[setting] = value
    if sorted(groups) != list(range(len(groups))) or not all("params" in group for group in groups.values()):
        raise CheckpointError(f"{path}: the optimizer's parameter groups are incomplete in the checkpoint")
    return [groups[index] for index in range(len(groups))]


def _load_optimizer(path: Path, layout: _Layout, optimizer, state: dict, buffers: dict) -> None:
    saved_groups = _saved_groups(path, state)
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(f"{path}: {len(saved_groups)} optimizer parameter groups in the checkpoint, "
                              f"{len(optimizer.param_groups)} here")
    index, groups, per_param = 0, [], {}
    for saved, group in zip(saved_groups, optimizer.param_groups):
        names = [layout.param_name(p) for p in group["params"]]
        if not isinstance(saved.get("params"), (list, tuple)) or names != list(saved["params"]):
            raise CheckpointError(f"{path}: the optimizer's parameters differ from the checkpoint's")
        groups.append({**saved, "params": list(range(index, index + len(names)))})
        for name in names:
            prefix = f"{STATE}{name}."
            entry = {key[len(prefix):]: buffers.get(key, state[key]) for key in state if key.startswith(prefix)}
            if entry:
                per_param[index] = entry
            index += 1
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})
