"""Mixed precision as FSDP2 defines it: fp32 master shards, gathers and compute in ``param_dtype``.

:class:`MixedPrecisionPolicy` has the fields of
``torch.distributed.fsdp.MixedPrecisionPolicy``, and :func:`policy_of`
accepts either. Under ``dcsched.shard(model, mp_policy=...)``:

- each shard keeps its own dtype (the optimizer's master weights);
- each all-gather casts the shard to ``param_dtype`` first, so it moves
  ``param_dtype``'s bytes, and the traced graph takes parameters of
  ``param_dtype`` (the stand-ins are of that dtype), so it computes in it;
- each gradient is cast to ``reduce_dtype`` (default: ``param_dtype``; in the
  compiled backward by a graph node before its reduce, :func:`carry_dtypes`),
  reduced in it, and lands in the shard's dtype;
- ``cast_forward_inputs`` casts the floating inputs of the module's forward to
  ``param_dtype``; ``output_dtype`` casts its floating outputs.

A field left None changes nothing (a policy of Nones is full precision).

>>> import torch
>>> policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
>>> policy.gather_dtype(torch.float32), policy.reduce_dtype_for(torch.float32)
(torch.bfloat16, torch.float32)
>>> MixedPrecisionPolicy(param_dtype=torch.bfloat16).reduce_dtype_for(torch.float32)  # as FSDP2: param_dtype
torch.bfloat16
>>> dtype_named("bf16")
torch.bfloat16
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.fx

from dcsched.errors import DcschedError
from dcsched.train.options import DTYPE_NAMES

#: The names ``dcsched train --param-dtype`` and alike take.
_DTYPES = {name: getattr(torch, attribute) for name, attribute in DTYPE_NAMES.items()}


class MixedPrecisionError(DcschedError):
    """A mixed-precision policy dcsched cannot run; the message says why."""


def dtype_named(name: str) -> torch.dtype:
    """The floating dtype ``name`` names (``bf16``, ``fp16``, ``fp32``, ``fp64`` or torch's long names)."""
    try:
        return _DTYPES[name.lower()]
    except (KeyError, AttributeError):
        raise MixedPrecisionError(f"unknown dtype {name!r}: one of {', '.join(sorted(_DTYPES))}") from None


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's ``MixedPrecisionPolicy``, field for field (see the module docstring)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise MixedPrecisionError(f"mp_policy.{field} must be a floating torch.dtype or None, not {value!r}")
        if not isinstance(self.cast_forward_inputs, bool):
            raise MixedPrecisionError(f"mp_policy.cast_forward_inputs must be True or False, not "
                                      f"{self.cast_forward_inputs!r}")

    def gather_dtype(self, shard_dtype: torch.dtype) -> torch.dtype:
        """The dtype a parameter of ``shard_dtype`` is gathered and computed in."""
        return self.param_dtype if self.param_dtype is not None else shard_dtype

    def reduce_dtype_for(self, shard_dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of a ``shard_dtype`` parameter is reduced in (FSDP2: ``reduce_dtype``, else
        ``param_dtype``, else the parameter's)."""
        return self.reduce_dtype if self.reduce_dtype is not None else self.gather_dtype(shard_dtype)

    def cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with their floating tensors in ``param_dtype`` (``cast_forward_inputs``)."""
        if not self.cast_forward_inputs or self.param_dtype is None:
            return args, kwargs
        return _cast_floating((args, kwargs), self.param_dtype)

    def cast_output(self, output):
        """``output`` with its floating tensors in ``output_dtype`` (unchanged without one)."""
        return output if self.output_dtype is None else _cast_floating(output, self.output_dtype)


def _cast_floating(tree, dtype: torch.dtype):
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                    and v.dtype != dtype else v, tree)


def policy_of(value) -> MixedPrecisionPolicy | None:
    """``value`` as a :class:`MixedPrecisionPolicy`: one already, FSDP2's (or any object with its four
    fields), or None (full precision, returned as None).

    >>> import torch
    >>> from torch.distributed.fsdp import MixedPrecisionPolicy as Fsdp2Policy
    >>> policy_of(Fsdp2Policy(param_dtype=torch.bfloat16))
    MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=None, output_dtype=None, cast_forward_inputs=True)
    >>> policy_of("bf16")
    Traceback (most recent call last):
    ...
    dcsched.train.mixed_precision.MixedPrecisionError: mp_policy must be a MixedPrecisionPolicy (dcsched's or \
torch.distributed.fsdp's), not str
    """
    if value is None:
        return None
    if isinstance(value, Mapping):
        raise MixedPrecisionError(
            "mp_policy takes one MixedPrecisionPolicy for the whole module, not a mapping: per-submodule policies "
            "(FSDP2's fully_shard(submodule, mp_policy=...) on each) are not supported: give the one policy every "
            "parameter is gathered, computed and reduced under")
    fields = [field.name for field in dataclasses.fields(MixedPrecisionPolicy)]
    if isinstance(value, MixedPrecisionPolicy) or all(hasattr(value, name) for name in fields):
        policy = MixedPrecisionPolicy(**{name: getattr(value, name) for name in fields})
        return None if policy == MixedPrecisionPolicy() else policy
    raise MixedPrecisionError(f"mp_policy must be a MixedPrecisionPolicy (dcsched's or torch.distributed.fsdp's), "
                              f"not {type(value).__name__}")


def from_names(param_dtype: str | None, reduce_dtype: str | None, output_dtype: str | None) -> \
        MixedPrecisionPolicy | None:
    """The policy ``dcsched train --param-dtype/--reduce-dtype/--output-dtype`` name (None: full precision)."""
    named = {field: dtype_named(name) for field, name in
             (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype), ("output_dtype", output_dtype))
             if name is not None}
    return MixedPrecisionPolicy(**named) if named else None


def carry_dtypes(bundle, specs) -> None:
    """Make a bundle captured from a sharded module's stand-ins say what a mixed-precision step moves, in place.

    The capture saw the stand-ins, of the gathered dtype; the step's inputs are the shards, of their own dtype
    (the master weights), and its gradients are reduced in the reduce dtype. So each parameter's
    :class:`~dcsched.bundle.core.ParamInfo` and parameter placeholder take the shard's dtype (the gathers keep
    their ``dtype``: the gathered bytes are ``param_dtype``'s), each gradient of another dtype is cast to the
    reduce dtype by a node right before its reduce, and the reduce's value is of the reduce dtype: the
    profile's ``tensor_size`` of shards, casts and reduces, the cost models' collective bytes and the
    simulator's memory follow. ``specs``: the sharding's :class:`~dcsched.train.sharding.ShardSpec` by ds_id.
    Nothing changes for a parameter outside mixed precision.
    """
    from dcsched.graph.roles import Role, role_of

    by_id = {spec.ds_id: spec for spec in specs}
    mixed = {ds_id for ds_id, spec in by_id.items() if spec.param_dtype != spec.dtype or spec.reduce_dtype
             not in (None, spec.param_dtype)}
    if not mixed:
        return
    bundle.params = [dataclasses.replace(p, dtype=by_id[p.ds_id].dtype) if p.ds_id in mixed else p
                     for p in bundle.params]
    for graph in bundle.graphs.values():
        for node in graph.nodes:
            role = role_of(node)
            if role is Role.ALLGATHER and node.meta.get("ds_id") in mixed:
                source = node.args[0]
                source.meta["val"] = _as_dtype(source.meta.get("val"), by_id[node.meta["ds_id"]].dtype)
            elif role is Role.REDUCE and node.meta.get("ds_id") in mixed:
                reduce_dtype = by_id[node.meta["ds_id"]].reduce_dtype
                if reduce_dtype is not None:
                    _cast_before(graph, node, reduce_dtype)
                    node.meta["val"] = _as_dtype(node.meta.get("val"), reduce_dtype)


def _cast_before(graph, reduce, dtype: torch.dtype) -> None:
    """Cast ``reduce``'s gradient to ``dtype`` in the graph, right before it: the cast copy is a tensor the
    simulator and the schedulers see (a bucket's flat input then holds its bytes, as the runtime's does)."""
    grad = reduce.args[0]
    value = grad.meta.get("val") if isinstance(grad, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dtype == dtype:
        return
    with graph.inserting_before(reduce):
        cast = graph.call_function(torch.ops.prims.convert_element_type.default, (grad, dtype))
    cast.meta["val"] = _as_dtype(value, dtype)
    reduce.replace_input_with(grad, cast)


def _as_dtype(value, dtype: torch.dtype):
    """A meta tensor like ``value`` (a fake or meta tensor) in ``dtype``; ``value`` itself if it is none."""
    if not isinstance(value, torch.Tensor) or value.dtype == dtype:
        return value
    return torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=dtype, device="meta")


@dataclasses.dataclass(frozen=True)
class _ShardDtypes:
    """What :func:`carry_dtypes` reads of a shard spec: its ds_id, the shard's (master) dtype, the gathered dtype
    and the reduce dtype."""

    ds_id: int
    dtype: torch.dtype
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype | None


def with_master_dtype(bundle, master_dtype: torch.dtype, reduce_dtype: torch.dtype | None = None) -> None:
    """Make a bundle captured from a model in its compute dtype say what FSDP2 runs under
    ``MixedPrecisionPolicy(param_dtype=<the captured dtype>, reduce_dtype=reduce_dtype)`` over master weights of
    ``master_dtype``, in place, before it is profiled (``dcsched profile --master-dtype ... --reduce-dtype ...``).

    Every floating parameter's shard becomes ``master_dtype`` (the optimizer's states follow it), its gathers
    stay the captured dtype, and its gradient is cast to ``reduce_dtype`` (default: the captured dtype) right
    before its reduce, as :func:`carry_dtypes` does for ``dcsched.shard(mp_policy=...)``; the provenance records
    the policy (``mixed_precision``).

    >>> from dcsched import replay
    >>> bundle = replay.example_bundle()
    >>> with_master_dtype(bundle, torch.float64)
    >>> bundle.params[0].dtype, bundle.provenance["mixed_precision"]["master_dtype"]
    (torch.float64, 'float64')
    """
    specs = [_ShardDtypes(p.ds_id, master_dtype, p.dtype, reduce_dtype) for p in bundle.params
             if p.dtype.is_floating_point]
    gathered = sorted({str(spec.param_dtype).removeprefix("torch.") for spec in specs})
    carry_dtypes(bundle, specs)
    bundle.provenance["mixed_precision"] = {
        "master_dtype": str(master_dtype).removeprefix("torch."), "param_dtype": ",".join(gathered),
        "reduce_dtype": str(reduce_dtype).removeprefix("torch.") if reduce_dtype is not None else None}
