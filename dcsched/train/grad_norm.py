"""The gradient norm of a sharded module is the whole gradient's: every rank clips with one coefficient.

Each rank holds a shard of every gradient, so torch's norm of ``param.grad``
would be the norm of that rank's shard: the ranks would clip by different
factors and drift apart. Once :func:`dcsched.shard` has sharded a module over
several ranks, :func:`install` makes torch's total-norm function
(``torch.nn.utils.get_total_norm``, which ``clip_grad_norm_``, accelerate and
Hugging Face's Trainer use; ``clip_grad_norm_`` itself on a torch without it)
combine the shards: for the gradients of dcsched's shards, each rank's norm
of its shards is raised to the power p, summed over the shard's process group
(a collective; the maximum for the infinity norm) and the root taken. Every
other tensor goes through torch's own function, so code that never touches a
dcsched shard sees no change; so do the gradients of replicated parameters
(``dcsched.shard(..., replicate_below=N)``): whole and equal on every rank,
each counts once, not once per rank.

Call the norm on every rank (as every training loop does): it is a collective
wherever a dcsched shard's gradient is among the tensors.

>>> import torch
>>> grads = [torch.tensor([3.0, 4.0])]
>>> float(total_norm(grads))   # no shard among them: torch's own norm
5.0
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

_TORCH: dict[str, Callable] = {}  # torch's own functions, once replaced


def _shard_groups() -> dict[int, object]:
    """id(gradient) -> process group, for the current gradient of every shard over more than one rank.

    Replicated parameters are left out: their gradients are whole on every rank, so the local norm is theirs.
    """
    from dcsched.train.full_state import shardings
    groups = {}
    for sharding in shardings():
        if sharding.world_size > 1:
            for spec in sharding.specs:
                if spec.param.grad is not None and not spec.replicated:
                    groups[id(spec.param.grad)] = sharding.group
    return groups


def _combined(local: torch.Tensor, norm_type: float, group) -> torch.Tensor:
    """The norm over a process group of the tensors whose norm on this rank is ``local``."""
    import torch.distributed as dist
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    if norm_type == 0:  # a count of non-zero elements
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        return local
    powered = local.double() ** norm_type
    dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
    return (powered ** (1.0 / norm_type)).to(local.dtype)


@torch.no_grad()
def total_norm(tensors: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2.0,
               error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm`` with the gradients of dcsched's shards combined over their ranks."""
    own = _TORCH.get("get_total_norm") or _local_total_norm
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    groups = _shard_groups() if tensors else {}
    sharded: dict[int, tuple[object, list[torch.Tensor]]] = {}
    rest = []
    for tensor in tensors:
        if id(tensor) in groups:
            group = groups[id(tensor)]
            sharded.setdefault(id(group), (group, []))[1].append(tensor)
        else:
            rest.append(tensor)
    if not sharded:
        return own(tensors, norm_type, error_if_nonfinite, foreach)
    norm_type = float(norm_type)
    # The same groups in the same order on every rank: the tensors' order is the parameters' order.
    parts = [_combined(own(grads, norm_type, False, foreach).float(), norm_type, group)
             for group, grads in sharded.values()]
    if rest:
        parts.append(own(rest, norm_type, False, foreach).float().to(parts[0].device))
    total = torch.linalg.vector_norm(torch.stack(parts), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so "
                           "it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                           "norm anyway, set `error_if_nonfinite=False`")
    return total


def _local_total_norm(tensors, norm_type, error_if_nonfinite, foreach):
    """A torch without ``get_total_norm``: the norm of the norms, as torch computes it."""
    if not tensors:
        return torch.tensor(0.0)
    device = tensors[0].device
    norms = torch.stack([torch.linalg.vector_norm(t.detach(), norm_type).to(device) for t in tensors])
    return torch.linalg.vector_norm(norms, norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over :func:`total_norm` (for a torch without ``get_total_norm``)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    groups = _shard_groups()
    if not any(id(grad) in groups for grad in grads):
        return _TORCH["clip_grad_norm_"](params, max_norm, norm_type, error_if_nonfinite, foreach)
    norm = total_norm(grads, norm_type, error_if_nonfinite, foreach)
    coefficient = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.device, grad.dtype))
    return norm


def install() -> None:
    """Route torch's gradient-norm functions through :func:`total_norm` (once; torch's own for other tensors).

    On a torch with ``get_total_norm`` (2.6 on) that function is replaced, in
    ``torch.nn.utils`` and where ``clip_grad_norm_`` looks it up, so a
    ``clip_grad_norm_`` imported by name before this call is covered too; on
    an older torch ``clip_grad_norm_`` is.
    """
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad
    if _TORCH:
        return
    if hasattr(clip_grad, "_get_total_norm"):
        _TORCH["get_total_norm"] = clip_grad._get_total_norm
        clip_grad._get_total_norm = utils.get_total_norm = total_norm
    else:
        _TORCH["clip_grad_norm_"] = utils.clip_grad_norm_
        utils.clip_grad_norm_ = clip_grad.clip_grad_norm_ = clip_grad_norm_
