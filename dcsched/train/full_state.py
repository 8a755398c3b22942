"""What the ecosystem sees of a sharded module's weights: full ones in its state dict.

:func:`dcsched.shard` keeps every parameter object and swaps its data for a
1-D padded shard (so an optimizer built before or after sees the shards).
Code outside dcsched that reads the parameters whole gets, through the hooks
:func:`install` puts on the module:

* ``module.state_dict()`` (and so ``save_pretrained``,
  ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with full
  state dicts, ``torch.save(model.state_dict())``): every sharded parameter
  in its full shape, gathered from the ranks. Like FSDP's full state dicts it
  is a collective under a process group of more than one rank: call it on
  every rank (saving on one alone is fine). The gathers run on a gloo group
  of their own, made when the module is sharded, so a call on one rank alone
  never pairs with a training collective: it waits :data:`STATE_DICT_WAIT_S`
  seconds for the others and stops with one line.
* ``module.load_state_dict(full)`` (``from_pretrained``-style weights,
  ``set_model_state_dict``): each full parameter is cut to this rank's shard,
  with no communication; a shard of the right size loads as it is.

A replicated parameter (``dcsched.shard(..., replicate_below=N)``) is whole
on every rank already: its state-dict entry is it, reshaped, with no gather,
and a full tensor loads into it flattened.

Gradient norms over the shards are :mod:`dcsched.train.grad_norm`'s.

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
import threading
import weakref
from typing import Iterator

import torch

from dcsched.runtime.distributed import shard_of
from dcsched.errors import first_line
from dcsched.train import grad_norm

#: Every module's Sharding, to find the shards among tensors handed to torch (gradient norms, graph pieces).
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


#: Seconds a rank's ``state_dict()`` waits for the other ranks to call it too before it gives up.
STATE_DICT_WAIT_S = 60.0


def _all_ranks_ask(sharding, group) -> None:
    import torch.distributed as dist

    from dcsched.train.sharding import ShardingError  # (sharding.py imports this module)
    try:
        dist.barrier(group=group)
    except RuntimeError as error:  # gloo's timeout: the other ranks are not gathering
        raise ShardingError(f"{type(sharding.module).__name__}.state_dict() gathers the full weights from every "
                            f"rank, and not every rank called it within {STATE_DICT_WAIT_S:g} s: call it (or "
                            "save_pretrained, get_model_state_dict) on every rank, saving on one; a Hugging Face "
                            "Trainer does so under dcsched train, elsewhere pass TrainingArguments("
                            f"save_strategy=\"no\") ({first_line(error)})") from None


def full_parameter(sharding, spec, group=None) -> torch.Tensor:
    """``spec``'s parameter in its full shape: the ranks' shards gathered over ``group`` (a collective) or the
    one shard."""
    shard = spec.param.detach()
    if sharding.world_size == 1 or spec.replicated:  # whole here already: no gather (every rank skips it alike)
        return shard[:spec.numel].view(spec.shape).clone()
    from dcsched.runtime.distributed import all_gather_into_tensor
    local = shard.to("cpu").contiguous()  # the state-dict group is gloo's, whatever the device
    gathered = torch.empty(local.numel() * sharding.world_size, dtype=local.dtype)
    all_gather_into_tensor(gathered, local, group=group)
    return gathered[:spec.numel].view(spec.shape).to(shard.device)


def _names(sharding) -> dict[str, object]:
    """Every name a sharded parameter has in the module (tied ones under each), to its spec."""
    by_param = {id(spec.param): spec for spec in sharding.specs}
    return {name: by_param[id(param)] for name, param in sharding.module.named_parameters(remove_duplicate=False)
            if id(param) in by_param}


def shardings() -> list:
    """Every live :class:`~dcsched.train.sharding.Sharding` of this process."""
    return list(_SHARDINGS)


def install(sharding) -> None:
    """Put the state-dict hooks on ``sharding.module``; its gradients' norms become global (grad_norm)."""
    names = _names(sharding)
    group = None
    if sharding.world_size > 1:  # every rank shards, so every rank makes the group (new_group is collective)
        import datetime

        import torch.distributed as dist
        ranks = dist.get_process_group_ranks(sharding.group or dist.group.WORLD)
        group = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=STATE_DICT_WAIT_S))

    def gather_full(_module, state_dict, prefix, _local_metadata):
        if getattr(_LOCAL, "raw", False):
            return state_dict
        if group is not None:
            _all_ranks_ask(sharding, group)
        full: dict[int, torch.Tensor] = {}
        for name, spec in names.items():  # in the same order on every rank: the gathers pair up
            key = prefix + name
            if key in state_dict:
                if id(spec) not in full:
                    full[id(spec)] = full_parameter(sharding, spec, group)
                state_dict[key] = full[id(spec)]
        return state_dict

    def cut_to_shard(state_dict, prefix, *_args):
        for name, spec in names.items():
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and tuple(value.shape) == spec.shape and \
                    tuple(value.shape) != tuple(spec.param.shape):
                value = value.detach().to(spec.param.device)
                state_dict[prefix + name] = value.reshape(-1) if spec.replicated else \
                    shard_of(value, sharding.rank, sharding.world_size)

    sharding.module._register_state_dict_hook(gather_full)
    sharding.module._register_load_state_dict_pre_hook(cut_to_shard)
    _SHARDINGS.add(sharding)
    grad_norm.install()
