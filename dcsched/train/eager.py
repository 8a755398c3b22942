"""Eager code around a sharded module: full parameters in eager module calls, one line for any other read.

:func:`dcsched.shard` leaves two kinds of tensor where a parameter was:

* the parameter object itself, holding this rank's 1-D shard (what the
  optimizer steps; outside a forward, ``model.weight`` is it);
* while the module's forward runs, a *stand-in* (:class:`StandIn`): the full
  shape with a storage of no bytes, which TorchDynamo traces and
  :func:`dcsched.backend` replaces by the shards.

Eager code must never compute with a stand-in: its storage holds nothing, and
an aten kernel would read past it (a segmentation fault, or garbage). So:

* **an eager module call** (a module run outside any compiled graph: the
  uncompiled module, ``model.generate()``, a module TorchDynamo left to run
  eagerly under ``torch._dynamo.disable`` such as a checkpointed layer under
  ``torch.utils.checkpoint``) gets its own full parameters, as FSDP2's
  pre-forward hooks give them: a forward pre-hook all-gathers the module's own
  sharded parameters over the sharding's process group and puts them where
  the module reads them, and a forward hook (run even when the forward
  raises) puts back what was there, freeing them. The gather is
  differentiable: its backward reduce-scatters the full gradient (averaged
  over the ranks, as the compiled backward does) into the shard's ``.grad``.
  Both are collectives, issued in module-call order in the forward and in
  autograd's order in the backward, the same on every rank when every rank
  makes the same calls (as a data-parallel script does). Where TorchDynamo
  is about to compile the module's forward (the eager stretch between two
  compiled graphs), nothing is gathered: the compiled graph takes the
  stand-ins and dcsched schedules it.
* **any other eager read of a stand-in** (a graph break inside a module that
  TorchDynamo compiles, a forward hook that prints a parameter, a parent
  reading a child's parameter outside the child's call) stops with one line
  naming the module and the parameter: :class:`StandIn`'s
  ``__torch_function__`` refuses every op but reading its metadata (shape,
  dtype, device) outside TorchDynamo's tracing.

>>> import torch, dcsched
>>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
>>> plain = model(torch.ones(1, 3))
>>> _ = dcsched.shard(model)
>>> torch.equal(model(torch.ones(1, 3)), plain)  # eager: each Linear gathers its own weights
True
>>> tuple(model[0].weight.shape)                  # outside a forward: this rank's shard
(12,)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dcsched.runtime.distributed import padded_numel

#: Tensor methods that read a stand-in's metadata, never its bytes: allowed in eager code.
_METADATA = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
    "element_size", "is_floating_point", "is_complex", "is_signed", "get_device", "untyped_storage", "data_ptr",
    "requires_grad_", "__hash__", "__len__",
})
#: Tensor properties that hand out the bytes (a view or a copy): refused like any other op.
_READING_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})


class StandIn(torch.Tensor):
    """A sharded parameter's full-shape stand-in (a storage of no bytes): traced by TorchDynamo, refused eagerly.

    Under TorchDynamo's tracing every op passes through as on a plain tensor
    (its results are plain tensors). Outside it, any op that would read the
    bytes raises :class:`~dcsched.train.sharding.ShardingError` naming the
    module and the parameter.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if not torch.compiler.is_compiling() and not _metadata_only(func):
            _refuse(args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _metadata_only(func) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: .shape, .dtype, .device, .requires_grad, .grad ...
        return getattr(getattr(func, "__self__", None), "__name__", "") not in _READING_PROPERTIES
    return name in _METADATA


def _refuse(args, kwargs) -> None:
    from dcsched.train.sharding import ShardingError, sharding_for_inputs  # (sharding.py imports this module)

    values = list(args) + list((kwargs or {}).values())
    flat = [v for value in values for v in (value if isinstance(value, (list, tuple)) else (value,))]
    stand_ins = [v for v in flat if isinstance(v, StandIn)]
    sharding = sharding_for_inputs(stand_ins)
    spec = next((found for found in map(sharding.spec_of_stand_in, stand_ins) if found is not None), None) \
        if sharding is not None else None
    if sharding is None or spec is None:
        raise ShardingError("eager code read a parameter dcsched.shard sharded, outside any compiled graph and any "
                            "eager module call: read it inside the module's call, or whole with model.state_dict()")
    owner = _owner_name(sharding.module, spec.name)
    raise ShardingError(
        f"{owner}'s parameter {spec.name} was read by eager code outside its module's call and outside the compiled "
        "graphs (a graph break or a hook inside the compiled forward, or a frame TorchDynamo gave up compiling): "
        "dcsched.shard keeps it sharded and gathers it only in those; compute with it in the module's forward "
        "(compiled without a graph break there, or in an uncompiled call of the module), or read it whole outside "
        "the forward with model.state_dict() (on every rank)")


def _owner_name(module: nn.Module, name: str) -> str:
    path = name.rpartition(".")[0]
    try:
        return type(module.get_submodule(path) if path else module).__name__
    except AttributeError:  # replaced since
        return type(module).__name__


def stand_in(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
             requires_grad: bool = True) -> StandIn:
    """A full-shape :class:`StandIn` whose storage holds no bytes (allocated once, then shrunk)."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    tensor.untyped_storage().resize_(0)
    tensor.requires_grad_(requires_grad)
    return tensor.as_subclass(StandIn)


# ---------------------------------------------------------------------------
# Eager module calls: gather on the way in, put back on the way out
# ---------------------------------------------------------------------------


def _dynamo_will_compile() -> bool:
    """Whether TorchDynamo's frame callback is on: an eager module call here has its forward compiled next."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:  # pragma: no cover (torch without TorchDynamo)
        return False
    callback = get_eval_frame_callback()
    return callback is not None and callback is not False


def _mean_over_ranks(out: torch.Tensor, flat: torch.Tensor, sharding) -> torch.Tensor:
    """Reduce-scatter ``flat`` into ``out`` (all-reduce in place where ``out`` is ``flat``), averaged."""
    import torch.distributed as dist

    from dcsched.runtime.distributed import reduce_scatter_tensor
    issue = dist.all_reduce if out is flat else reduce_scatter_tensor
    args = (flat,) if out is flat else (out, flat)
    try:
        issue(*args, op=dist.ReduceOp.AVG, group=sharding.group)
        return out
    except (ValueError, RuntimeError):  # a backend without AVG (some gloo builds)
        issue(*args, op=dist.ReduceOp.SUM, group=sharding.group)
        return out.div_(sharding.world_size)


def full_of(sharding, spec, shard: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``spec``'s full parameter from this rank's ``shard``: all-gathered over the sharding's group (a
    collective) or, whole here already (one rank, replicated), a copy; cast to ``dtype`` (if given) before
    the gather, so the gather moves that dtype's bytes."""
    if dtype is not None and dtype != shard.dtype:
        shard = shard.to(dtype)
    if sharding.world_size == 1 or spec.replicated:
        return shard[:spec.numel].view(spec.shape).clone()
    from dcsched.runtime.distributed import all_gather_into_tensor
    gathered = shard.new_empty(shard.numel() * sharding.world_size)
    all_gather_into_tensor(gathered, shard.contiguous(), group=sharding.group)
    return gathered[:spec.numel].view(spec.shape)


def shard_gradient(sharding, spec, grad: torch.Tensor) -> torch.Tensor:
    """The full gradient ``grad`` as this rank's shard's: averaged over the ranks, as the compiled backward's."""
    flat = grad.reshape(-1)
    if sharding.world_size == 1:
        return flat.clone()
    if spec.replicated:  # whole on every rank: all-reduced, as the compiled backward's
        whole = flat.clone()
        return _mean_over_ranks(whole, whole, sharding)
    total = padded_numel(flat.numel(), sharding.world_size)
    padded = torch.cat([flat, flat.new_zeros(total - flat.numel())]) if total != flat.numel() else flat.contiguous()
    out = flat.new_empty(total // sharding.world_size)
    return _mean_over_ranks(out, padded, sharding)


class _Gather(torch.autograd.Function):
    """The full parameter from its shard (in the compute dtype); backward: the gradient reduce-scattered (in the
    reduce dtype) into the shard's (in its dtype)."""

    @staticmethod
    def forward(ctx, shard, sharding, spec):
        ctx.sharding, ctx.spec = sharding, spec
        return full_of(sharding, spec, shard.detach(), spec.param_dtype)  # in the compute dtype (mp_policy)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        if spec.reduce_dtype is not None and grad.dtype != spec.reduce_dtype:  # mp_policy: reduced in its dtype
            grad = grad.to(spec.reduce_dtype)
        return shard_gradient(ctx.sharding, spec, grad).to(spec.dtype), None, None


def install(sharding) -> None:
    """Put the eager-call gathers on every submodule of ``sharding.module`` that holds a sharded parameter."""
    by_param = {id(spec.param): spec for spec in sharding.specs}
    for module in sharding.module.modules():
        own = [(name, by_param[id(param)]) for name, param in module._parameters.items()
               if param is not None and id(param) in by_param]
        if own:
            _hook(module, sharding, own)


def _hook(module: nn.Module, sharding, own: list) -> None:
    # Per active eager call that gathered (a module may call itself): (name, what was there, the full tensor).
    # Nothing changes while TorchDynamo traces the hooks (they trace to nothing) or is about to compile the
    # forward (the compiled graph takes the stand-ins).
    calls: list[list[tuple[str, object, torch.Tensor]]] = []

    def gather(_module, _args):
        if torch.compiler.is_compiling() or _dynamo_will_compile():
            return None
        swapped = []
        for name, spec in own:
            current = module._parameters.get(name)
            if current is spec.param or any(current is s for s in spec.stand_ins):  # the shard, or a forward's stand-in
                full = _Gather.apply(spec.param, sharding, spec)
                swapped.append((name, current, full))
                module._parameters[name] = full
        if swapped:
            calls.append(swapped)
            module._forward_hooks.move_to_end(last.id)
        return None

    def put_back(_module, _args, _output):
        if torch.compiler.is_compiling() or not calls:
            return None
        if all(module._parameters.get(name) is full for name, _before, full in calls[-1]):
            for name, before, _full in calls.pop():
                module._parameters[name] = before
        return None

    # The gather runs before any other pre-hook and the put-back after every forward hook (moved last at each
    # eager call), so the user's own hooks see the full parameters too.
    module.register_forward_pre_hook(gather, prepend=True)
    last = module.register_forward_hook(put_back, always_call=True)
