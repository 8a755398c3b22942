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
