"""What the ecosystem sees of a sharded module: full weights in its state dict, the global gradient norm.

:func:`dcsched.shard` keeps every parameter object and swaps its data for a
1-D padded shard (so an optimizer built before or after sees the shards).
Code outside dcsched that reads the parameters whole gets, through the hooks
:func:`install` puts on the module:

* ``module.state_dict()`` (and so ``save_pretrained``,
  ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with full
  state dicts, ``torch.save(model.state_dict())``): every sharded parameter
  in its full shape, gathered from the ranks. Like FSDP's full state dicts it
  is a collective under a process group of more than one rank: call it on
  every rank (saving on one alone is fine, gathering on one alone would wait
  for the others until the process-group timeout).
* ``module.load_state_dict(full)`` (``from_pretrained``-style weights,
  ``set_model_state_dict``): each full parameter is cut to this rank's shard,
  with no communication; a shard of the right size loads as it is.
* ``torch.nn.utils.clip_grad_norm_``: over parameters dcsched sharded across
  several ranks, the norm is the norm of the whole gradient (each rank's
  shard norms combined over the group), so every rank clips with the same
  coefficient; for any other parameter it is torch's own function, unchanged.

dcsched's own checkpoints store the shards themselves (no gather): they read
the module's state through :func:`local_state_dict`.

>>> import torch
>>> from dcsched.train.sharding import shard
>>> model = torch.nn.Linear(3, 2)
>>> _ = shard(model)
>>> {name: tuple(value.shape) for name, value in model.state_dict().items()}
{'weight': (2, 3), 'bias': (2,)}
>>> model.load_state_dict(torch.nn.Linear(3, 2).state_dict())
<All keys matched successfully>
>>> tuple(model.weight.shape)
(6,)
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from typing import Iterable, Iterator

import torch

from ..distributed import shard_of

#: Every module's Sharding, to find the shards among the parameters clip_grad_norm_ is given.
_SHARDINGS: "weakref.WeakSet" = weakref.WeakSet()
_LOCAL = threading.local()  # .raw: state_dict() gives the shards (dcsched's checkpoints)


@contextlib.contextmanager
def local_state_dict() -> Iterator[None]:
    """Within the block, ``state_dict()`` of a sharded module holds the shards as they are (no gather)."""
    before = getattr(_LOCAL, "raw", False)
    _LOCAL.raw = True
    try:
        yield
    finally:
        _LOCAL.raw = before


def any_sharded() -> bool:
    """Whether this process holds a module :func:`dcsched.shard` sharded."""
    return len(_SHARDINGS) > 0


def full_parameter(sharding, spec) -> torch.Tensor:
    """``spec``'s parameter in its full shape: the ranks' shards gathered (a collective) or the one shard."""
    shard = spec.param.detach()
    if sharding.world_size == 1:
        return shard[:spec.numel].view(spec.shape).clone()
    from ..distributed import all_gather_into_tensor
    gathered = torch.empty(shard.numel() * sharding.world_size, dtype=shard.dtype, device=shard.device)
    all_gather_into_tensor(gathered, shard.contiguous(), group=sharding.group)
    return gathered[:spec.numel].view(spec.shape)


def _names(sharding) -> dict[str, object]:
    """Every name a sharded parameter has in the module (tied ones under each), to its spec."""
    by_param = {id(spec.param): spec for spec in sharding.specs}
    return {name: by_param[id(param)] for name, param in sharding.module.named_parameters(remove_duplicate=False)
            if id(param) in by_param}


def install(sharding) -> None:
    """Put the state-dict hooks on ``sharding.module`` and register it for ``clip_grad_norm_``."""
    names = _names(sharding)

    def gather_full(_module, state_dict, prefix, _local_metadata):
        if getattr(_LOCAL, "raw", False):
            return state_dict
        full: dict[int, torch.Tensor] = {}
        for name, spec in names.items():  # in the same order on every rank: the gathers pair up
            key = prefix + name
            if key in state_dict:
                if id(spec) not in full:
                    full[id(spec)] = full_parameter(sharding, spec)
                state_dict[key] = full[id(spec)]
        return state_dict

    def cut_to_shard(state_dict, prefix, *_args):
        for name, spec in names.items():
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and tuple(value.shape) == spec.shape and \
                    tuple(value.shape) != tuple(spec.param.shape):
                state_dict[prefix + name] = shard_of(value.detach().to(spec.param.device), sharding.rank,
                                                     sharding.world_size)

    sharding.module._register_state_dict_hook(gather_full)
    sharding.module._register_load_state_dict_pre_hook(cut_to_shard)
    _SHARDINGS.add(sharding)
    _patch_clip_grad_norm()


# ---------------------------------------------------------------------------
# The global gradient norm
# ---------------------------------------------------------------------------

def _groups_of(params: list[torch.Tensor]) -> tuple[dict[int, tuple[object, list[torch.Tensor]]], list]:
    """The parameters' gradients split by process group (dcsched's shards over >1 rank) and the rest."""
    shard_group = {}
    for sharding in list(_SHARDINGS):
        if sharding.world_size > 1:
            for spec in sharding.specs:
                shard_group[id(spec.param)] = sharding.group
    sharded: dict[int, tuple[object, list[torch.Tensor]]] = {}
    rest = []
    for param in params:
        if param.grad is None:
            continue
        if id(param) in shard_group:
            group = shard_group[id(param)]
            sharded.setdefault(id(group), (group, []))[1].append(param.grad)
        else:
            rest.append(param.grad)
    return sharded, rest


def _local_norm(grads: list[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32).to(device)
                         for g in grads])
    return torch.linalg.vector_norm(norms, norm_type)


def total_norm(parameters: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type`` norm of all the parameters' gradients, the shards of each sharded one combined.

    The same value on every rank (a collective over each sharded group), as
    torch's ``clip_grad_norm_`` returns for unsharded parameters.
    """
    import torch.distributed as dist
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    sharded, rest = _groups_of(params)
    device = next((p.grad.device for p in params if p.grad is not None), torch.device("cpu"))
    parts = [_local_norm(rest, norm_type, device)]
    for group, grads in sharded.values():  # in the order of the parameters given: the same on every rank
        local = _local_norm(grads, norm_type, device)
        if math.isinf(norm_type):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
            parts.append(local)
        else:
            powered = local.double() ** norm_type
            dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
            parts.append((powered ** (1.0 / norm_type)).float())
    return torch.linalg.vector_norm(torch.stack(parts), norm_type)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over dcsched's shards: the whole gradient's norm, one coefficient.

    Parameters that dcsched did not shard over several ranks go to torch's
    own function unchanged.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    sharded, _rest = _groups_of(params)
    if not sharded:
        return _TORCH_CLIP[0](params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    norm = total_norm(params, norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the gradients by "
                           "the non-finite norm anyway, set `error_if_nonfinite=False`")
    coefficient = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for param in params:
            if param.grad is not None:
                param.grad.mul_(coefficient.to(param.grad.device, param.grad.dtype))
    return norm


_TORCH_CLIP: list = []  # torch's own clip_grad_norm_, once patched


def _patch_clip_grad_norm() -> None:
    """``torch.nn.utils.clip_grad_norm_`` becomes :func:`clip_grad_norm_` (torch's own for unsharded ones)."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_module
    if _TORCH_CLIP:
        return
    _TORCH_CLIP.append(utils.clip_grad_norm_)
    utils.clip_grad_norm_ = clip_module.clip_grad_norm_ = clip_grad_norm_
