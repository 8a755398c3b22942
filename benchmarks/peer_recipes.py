"""The recipes ``benchmarks/train_peers.py`` trains beside the example models: Hugging Face's Llama (its layers
checkpointed by ``gradient_checkpointing_enable``) and bf16 mixed precision (``--mp-policy``), for dcsched and
FSDP2 alike.
"""

from __future__ import annotations

import torch


def hf_llama(size: dict, form: str):
    """transformers' Llama of the example Llama's size (its MLP width, multi-head attention), seeded; ``form``
    full or reentrant: ``gradient_checkpointing_enable`` with ``use_reentrant`` False or True."""
    import math

    import transformers
    torch.manual_seed(0)
    width = size["d_model"]
    config = transformers.LlamaConfig(
        num_hidden_layers=size["n_layers"], hidden_size=width, num_attention_heads=size["n_heads"],
        num_key_value_heads=size["n_heads"], intermediate_size=64 * math.ceil(8 * width / 3 / 64),
        vocab_size=size["vocab"], max_position_embeddings=size["seq"], use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    if form != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": form == "reentrant"})
    return model


def mixed_precision(name: str, fsdp2: bool):
    """``--mp-policy name`` as ``dcsched.shard``'s ``mp_policy`` (``fsdp2``: as ``fully_shard``'s keyword
    arguments); none: full precision (None, no keyword)."""
    if name == "none":
        return {} if fsdp2 else None
    if fsdp2:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    from dcsched import MixedPrecisionPolicy as Policy
    return Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


# --------------------------------------------------------------------------- the ZeRO-3 peers' setups
#
# Each as its framework's documentation sets it up: FSDP2's tutorial and API reference (explicit prefetching,
# ``_set_unshard_async_op``), torchtitan's ``apply_compile`` (a compiled transformer block registered in place
# of each block, then ``fully_shard``) and torchtitan's SimpleFSDP (``torchtitan/experiments/simple_fsdp``:
# DTensor shards gathered by a parametrization, the whole model compiled).

#: The SimpleFSDP row's Inductor bucket cap, MB: about one transformer block of the default GPT (d_model 256:
#: 12 d^2 + 13 d floats, 3.2 MB).
SIMPLEFSDP_BUCKET_MB = 3.2


def block_container(model):
    """The ``nn.ModuleList`` holding the model's transformer blocks: the example GPT's and Llama's ``blocks``,
    Hugging Face Llama's ``model.layers``."""
    return model.blocks if hasattr(model, "blocks") else model.model.layers


def compile_blocks(model) -> None:
    """torchtitan's per-block compile: each transformer block replaced by ``torch.compile(block,
    fullgraph=True)`` in its container (before ``fully_shard``, whose hooks then run eagerly around the compiled
    block); the rest of the model stays eager."""
    container = block_container(model)
    for index, block in enumerate(list(container)):
        container[index] = torch.compile(block, fullgraph=True, dynamic=False)


def fsdp2(model, policy: dict, *, prefetch: bool = False) -> None:
    """``fully_shard`` on each transformer block, then on the root (FSDP2's tutorial's wrapping).

    ``prefetch``: every FSDP module's unshard asynchronous (``_set_unshard_async_op(True)``, recursive from the
    root) and explicit prefetching one block ahead: in the forward the root prefetches the first block and
    each block the next, in the backward the root the last block and each block the one before it.
    """
    from torch.distributed.fsdp import fully_shard
    blocks = list(block_container(model))
    for block in blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    if not prefetch:
        return
    model._set_unshard_async_op(True)
    model.set_modules_to_forward_prefetch([blocks[0]])
    model.set_modules_to_backward_prefetch([blocks[-1]])
    for index, block in enumerate(blocks):
        if index + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[index + 1]])
        if index > 0:
            block.set_modules_to_backward_prefetch([blocks[index - 1]])


class _GatherForCompute(torch.nn.Module):
    """SimpleFSDP's parametrization: a ``Shard(0)`` DTensor parameter redistributed to ``Replicate`` (an
    all-gather) and handed to the module's compute as a plain tensor whose gradient is ``Partial`` (averaged),
    so the backward reduce-scatters it into the shard's gradient."""

    def forward(self, shard):
        from torch.distributed.tensor import Partial, Replicate
        full = shard.redistribute(placements=[Replicate()])
        return full.to_local(grad_placements=[Partial("avg")])


def simple_fsdp(model, world_size: int):
    """A SimpleFSDP-style model: every parameter a ``Shard(0)`` DTensor on a 1-D mesh of the ranks, gathered
    through :class:`_GatherForCompute` (``torch.nn.utils.parametrize``, ``unsafe``: the gathered tensor is
    larger than the shard) wherever a module reads it. A parameter two modules share (the GPT's tied
    embedding) is one DTensor, parametrized in both. Returns the model, to be compiled whole with
    :func:`simplefsdp_compile_options`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.nn.utils import parametrize
    mesh = init_device_mesh("cpu", (world_size,))
    sharded: dict[int, torch.nn.Parameter] = {}
    owners = []
    for module in list(model.modules()):
        for name, parameter in list(module.named_parameters(recurse=False)):
            if id(parameter) not in sharded:
                sharded[id(parameter)] = torch.nn.Parameter(
                    distribute_tensor(parameter.detach(), mesh, [Shard(0)]), requires_grad=parameter.requires_grad)
            owners.append((module, name, sharded[id(parameter)]))
    gather = _GatherForCompute()
    for module, name, parameter in owners:
        delattr(module, name)
        module.register_parameter(name, parameter)
        parametrize.register_parametrization(module, name, gather, unsafe=True)
    return model


def _bucket_cap_mb(bucket_index: int) -> float:
    """Inductor's bucket-size determinator for the SimpleFSDP row: every bucket capped at
    :data:`SIMPLEFSDP_BUCKET_MB`."""
    return SIMPLEFSDP_BUCKET_MB


def simplefsdp_compile_options() -> dict:
    """``torch.compile(options=...)`` for the SimpleFSDP row (Inductor's config, for this compile alone): its FX
    passes bucket the all-gathers and the reduce-scatters (``bucket_all_gathers_fx``,
    ``bucket_reduce_scatters_fx``, each bucket capped at about one block) and its scheduler reorders
    communication for overlap with the compute (``reorder_for_compute_comm_overlap``). Inductor's
    ``aten_distributed_optimizations.enable_overlap_scheduling`` needs triton and is not used (a CPU-only torch
    has none)."""
    return {"bucket_all_gathers_fx": "all", "bucket_all_gathers_fx_bucket_size_determinator": _bucket_cap_mb,
            "bucket_reduce_scatters_fx": "all", "bucket_reduce_scatters_fx_bucket_size_determinator": _bucket_cap_mb,
            "reorder_for_compute_comm_overlap": True}


def check_sharded_gradients(model, world_size: int) -> None:
    """Raise ``AssertionError`` unless every parameter of a :func:`simple_fsdp` model is a ``Shard(0)`` DTensor
    whose gradient, after a backward, is one too (what the optimizer steps: the shards, not gathered copies)."""
    from torch.distributed.tensor import DTensor, Shard
    for name, parameter in model.named_parameters():
        grad = parameter.grad
        for what, tensor in (("parameter", parameter), ("gradient", grad)):
            if not isinstance(tensor, DTensor) or tuple(tensor.placements) != (Shard(0),):
                raise AssertionError(f"simplefsdp: {name}'s {what} is not a Shard(0) DTensor: {type(tensor)}")
        if grad.to_local().shape != parameter.to_local().shape or (
                parameter.shape[0] >= world_size and parameter.to_local().shape[0] == parameter.shape[0]):
            raise AssertionError(f"simplefsdp: {name}'s local shard {tuple(parameter.to_local().shape)} is not "
                                 f"1/{world_size} of {tuple(parameter.shape)}")
