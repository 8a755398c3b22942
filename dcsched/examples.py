"""Small, configurable pure-PyTorch models for dcsched's examples, tests and benchmarks.

Every model is randomly initialised (no downloads) and its ``forward`` returns
the training loss when given targets, so a compiled model's step ends in a
scalar loss::

    >>> model, inputs, loss_fn = build("gpt", n_layers=2, d_model=64, vocab=128, seq=16, batch=2)
    >>> loss = loss_fn(model(*inputs))
    >>> loss.shape
    torch.Size([])

``build(name, **config) -> (model, example_inputs, loss_fn)`` with ``name`` one
of ``gpt``, ``convnet``, ``llama``, ``mixtral`` (Llama with mixture-of-experts MLPs),
``t5`` (encoder-decoder with dropout), ``vit`` (vision transformer); the keyword arguments override the
defaults in :data:`DEFAULTS` (e.g. ``n_layers=48, d_model=1024`` for a
benchmark-sized GPT). ``loss_fn(output)`` turns the model's output into the
scalar loss (the identity here, since the models compute their loss).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------
# GPT-style decoder (tied input/output embeddings)
# ---------------------------------------------------------------------------


def _drop(x, p: float, training: bool):
    """``F.dropout`` where it does something: a model with ``p == 0`` traces to the same graph as before."""
    return F.dropout(x, p, training) if p > 0 and training else x


def _init_weights(module: nn.Module) -> None:
    """GPT-2-style initialisation, so the loss starts near log(vocab)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a fused qkv projection; causal unless ``causal=False`` (ViT's)."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, causal: bool = True):
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.causal = causal
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (y.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for y in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        return _drop(self.proj(y.transpose(1, 2).reshape(b, t, c)), self.dropout, self.training)


class GPTBlock(nn.Module):
    """A pre-norm transformer block (LayerNorm, attention, LayerNorm, GELU MLP): GPT-2's, and ViT's with
    ``causal=False``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, causal: bool = True):
        super().__init__()
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout, causal)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + _drop(self.out(F.gelu(self.fc(self.ln2(x)))), self.dropout, self.training)


class GPT(nn.Module):
    """A GPT-2-style decoder; the output head shares the token embedding's weight.

    ``dropout`` > 0 drops, as GPT-2 does, the embeddings, the attention weights and each residual
    branch's output (in training mode).
    """

    def __init__(self, vocab: int = 512, seq: int = 64, d_model: int = 128, n_heads: int = 4, n_layers: int = 2,
                 dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        self.apply(_init_weights)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = _drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)), self.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------------
# Llama-style decoder: RMSNorm, SwiGLU, optional rotary embeddings
# ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq: int, head_dim: int, base: float = 10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), inv_freq)
    return torch.cos(angles), torch.sin(angles)


def apply_rotary(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    # the tables are fp32: under a bf16 param_dtype the rotation runs in fp32 and lands in x's dtype (as
    # torchtitan's type_as); in fp32 the cast is no op of the graph
    return rotated.flatten(-2).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, cos, sin):
        b, t, c = x.shape
        h = self.n_heads
        q, k, v = (w(x).view(b, t, h, c // h).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if cos is not None:
            q, k = apply_rotary(q, cos[:t], sin[:t]), apply_rotary(k, cos[:t], sin[:t])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, c))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """Mixtral-style mixture of experts: a router, ``n_experts`` SwiGLU experts, each token to ``top_k`` of them.

    Static shapes, so it traces: each expert takes the ``capacity`` tokens
    (tokens x top_k / experts) whose renormalised router weight for it is
    highest, a token not among its expert's top ones being dropped there.
    """

    def __init__(self, d_model: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d_model, hidden) for _ in range(n_experts))
        self.top_k = top_k

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(torch.softmax(self.router(tokens), -1), self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        capacity = max(1, tokens.shape[0] * self.top_k // len(self.experts))
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            gate, idx = torch.topk((weights * (chosen == e)).sum(-1), capacity)
            out = out.index_add(0, idx, expert(tokens[idx]) * gate[:, None])
        return out.view_as(x)


class LlamaBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, hidden: int, n_experts: int = 0, top_k: int = 2):
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = LlamaAttention(d_model, n_heads)
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = MoE(d_model, hidden, n_experts, top_k) if n_experts else SwiGLU(d_model, hidden)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


#: The activation checkpointing forms :class:`Llama` offers, each block checkpointed with
#: ``torch.utils.checkpoint.checkpoint``: ``full`` (non-reentrant), ``reentrant``, ``selective`` (torchtitan's
#: kind: the matmuls' and attention's outputs saved, the rest recomputed; :func:`save_matmuls`).
CHECKPOINTING = ("none", "full", "reentrant", "selective")

#: The ops whose outputs the ``selective`` policy saves.
_SAVED_BY_SELECTIVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                       torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                       torch.ops.aten._scaled_dot_product_efficient_attention.default,
                       torch.ops.aten._scaled_dot_product_flash_attention.default}


def save_matmuls(ctx, op, *args, **kwargs):
    """A selective checkpointing policy (``create_selective_checkpoint_contexts``'s): save matmul and attention
    outputs, recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(block: nn.Module, form: str, *args):
    """``block(*args)`` under activation checkpointing ``form`` (one of :data:`CHECKPOINTING`)."""
    if form == "none":
        return block(*args)
    import functools

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    if form == "selective":
        return checkpoint(block, *args, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, save_matmuls))
    return checkpoint(block, *args, use_reentrant=form == "reentrant")


class Llama(nn.Module):
    """A Llama-style decoder (untied output head); ``rotary=False`` drops the rotary embeddings.

    ``n_experts`` > 0 makes it Mixtral-style: each block's MLP is a :class:`MoE`. ``checkpointing`` (one of
    :data:`CHECKPOINTING`) checkpoints each block in training.
    """

    def __init__(self, vocab: int = 512, seq: int = 64, d_model: int = 128, n_heads: int = 4, n_layers: int = 2,
                 hidden: int | None = None, rotary: bool = True, n_experts: int = 0, top_k: int = 2,
                 checkpointing: str = "none"):
        super().__init__()
        if checkpointing not in CHECKPOINTING:
            raise ValueError(f"unknown checkpointing {checkpointing!r} (choose from {', '.join(CHECKPOINTING)})")
        self.checkpointing = checkpointing
        hidden = hidden or 64 * math.ceil(8 * d_model / 3 / 64)
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(LlamaBlock(d_model, n_heads, hidden, n_experts, top_k) for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.rotary = rotary
        cos, sin = rotary_tables(seq, d_model // n_heads)
        # Non-persistent buffers: step inputs of the captured graph, not parameters.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.apply(_init_weights)

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        cos, sin = (self.cos, self.sin) if self.rotary else (None, None)
        form = self.checkpointing if self.training and torch.is_grad_enabled() else "none"
        for block in self.blocks:
            x = checkpointed(block, form, x, cos, sin)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------------
# T5-style encoder-decoder (shared embedding, RMS norms, dropout everywhere)
# ---------------------------------------------------------------------------


class T5Attention(nn.Module):
    """T5's attention: no bias, no 1/sqrt(d) scaling, dropout on the attention weights."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def forward(self, x, memory=None, causal: bool = False):
        memory = x if memory is None else memory
        b, t, c = x.shape
        h = self.n_heads

        def heads(y):
            return y.view(b, -1, h, c // h).transpose(1, 2)

        scores = heads(self.q(x)) @ heads(self.k(memory)).transpose(-1, -2)
        if causal:
            future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        weights = _drop(scores.softmax(-1), self.dropout, self.training)
        return self.o((weights @ heads(self.v(memory))).transpose(1, 2).reshape(b, t, c))


class T5FeedForward(nn.Module):
    def __init__(self, d_model: int, hidden: int, dropout: float):
        super().__init__()
        self.dropout = dropout
        self.wi = nn.Linear(d_model, hidden, bias=False)
        self.wo = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.wo(_drop(F.relu(self.wi(x)), self.dropout, self.training))


class T5Block(nn.Module):
    """An encoder block, or with ``cross=True`` a decoder block (causal self-attention, then cross-attention)."""

    def __init__(self, d_model: int, n_heads: int, hidden: int, dropout: float, cross: bool = False):
        super().__init__()
        self.dropout = dropout
        self.self_norm, self.self_attn = RMSNorm(d_model), T5Attention(d_model, n_heads, dropout)
        self.cross_norm = RMSNorm(d_model) if cross else None
        self.cross_attn = T5Attention(d_model, n_heads, dropout) if cross else None
        self.ff_norm, self.ff = RMSNorm(d_model), T5FeedForward(d_model, hidden, dropout)

    def forward(self, x, memory=None):
        drop = self.dropout if self.training else 0.0
        x = x + _drop(self.self_attn(self.self_norm(x), causal=self.cross_attn is not None), drop, True)
        if self.cross_attn is not None:
            x = x + _drop(self.cross_attn(self.cross_norm(x), memory), drop, True)
        return x + _drop(self.ff(self.ff_norm(x)), drop, True)


class T5(nn.Module):
    """A T5-style encoder-decoder: the encoder and decoder share the token embedding; dropout (default
    0.1, as T5's) on the embeddings, the attention weights, the feed-forward hidden layer, every
    residual branch and both stacks' outputs. ``n_layers`` blocks in each stack."""

    def __init__(self, vocab: int = 512, seq: int = 64, d_model: int = 128, n_heads: int = 4, n_layers: int = 2,
                 hidden: int | None = None, dropout: float = 0.1):
        super().__init__()
        hidden = hidden or 4 * d_model
        self.dropout = dropout
        self.shared = nn.Embedding(vocab, d_model)
        self.encoder = nn.ModuleList(T5Block(d_model, n_heads, hidden, dropout) for _ in range(n_layers))
        self.encoder_norm = RMSNorm(d_model)
        self.decoder = nn.ModuleList(T5Block(d_model, n_heads, hidden, dropout, cross=True)
                                     for _ in range(n_layers))
        self.decoder_norm = RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.apply(_init_weights)

    def forward(self, src, tgt_in, targets=None):
        x = _drop(self.shared(src), self.dropout, self.training)
        for block in self.encoder:
            x = block(x)
        memory = _drop(self.encoder_norm(x), self.dropout, self.training)
        y = _drop(self.shared(tgt_in), self.dropout, self.training)
        for block in self.decoder:
            y = block(y, memory)
        logits = self.head(_drop(self.decoder_norm(y), self.dropout, self.training))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------------
# Vision transformer (ViT): patch embedding, class token, learned positions
# ---------------------------------------------------------------------------


class ViT(nn.Module):
    """A ViT classifier: a ``patch`` x ``patch`` stride-``patch`` convolution embeds the patches, a learned
    class token and position embedding are added, then pre-norm blocks (:class:`GPTBlock` without the
    causal mask), a final LayerNorm and a linear head on the class token."""

    def __init__(self, n_classes: int = 10, image: int = 32, patch: int = 8, channels: int = 3,
                 d_model: int = 128, n_heads: int = 4, n_layers: int = 2, dropout: float = 0.0):
        super().__init__()
        if image % patch:
            raise ValueError(f"image size {image} is not a multiple of the patch size {patch}")
        self.dropout = dropout
        self.patch_embed = nn.Conv2d(channels, d_model, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, d_model))
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_heads, dropout, causal=False) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)
        self.apply(_init_weights)
        nn.init.normal_(self.cls, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, images, labels=None):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (batch, patches, d_model)
        x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1) + self.pos
        x = _drop(x, self.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)[:, 0])
        if labels is None:
            return logits
        return F.cross_entropy(logits, labels)


# ---------------------------------------------------------------------------
# Convolutional net
# ---------------------------------------------------------------------------


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, groups: int = 8, norm: str = "group"):
        super().__init__()

        def make_norm():
            return nn.BatchNorm2d(c_out) if norm == "batch" else nn.GroupNorm(min(groups, c_out), c_out)

        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = make_norm()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = make_norm()
        self.skip = (nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)
                     if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x):
        y = F.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return F.relu(y + self.skip(x))


class ConvNet(nn.Module):
    """A small ResNet-style classifier: GroupNorm (no running statistics), or BatchNorm with ``norm='batch'``."""

    def __init__(self, n_classes: int = 10, width: int = 32, n_layers: int = 2, image: int = 32, channels: int = 3,
                 stages: int = 4, norm: str = "group"):
        super().__init__()
        self.stem = nn.Conv2d(channels, width, 3, padding=1, bias=False)
        # ResNet's layout: ``stages`` stages (default 4), each halving the resolution in its first block
        # and doubling the channels up to 8 x width (with no more layers than stages, every block after
        # the first is a new stage; stages=n_layers downsamples in every block).
        n_stages = min(stages, n_layers)
        blocks, c, stage = [], width, 0
        for i in range(n_layers):
            new_stage = i * n_stages // n_layers
            c_out = width * 2 ** min(new_stage, 3)
            blocks.append(ConvBlock(c, c_out, stride=2 if new_stage != stage else 1, norm=norm))
            c, stage = c_out, new_stage
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c, n_classes)

    def forward(self, images, labels=None):
        x = F.relu(self.stem(images))
        x = self.blocks(x)
        logits = self.fc(x.mean(dim=(2, 3)))
        if labels is None:
            return logits
        return F.cross_entropy(logits, labels)


# ---------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------

#: Default configurations: small enough for tests and sample graphs.
DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt": {"n_layers": 2, "d_model": 128, "n_heads": 4, "vocab": 512, "seq": 64, "batch": 4, "dropout": 0.0},
    "llama": {"n_layers": 2, "d_model": 128, "n_heads": 4, "vocab": 512, "seq": 64, "batch": 4, "rotary": True,
              "hidden": None, "checkpointing": "none"},
    "mixtral": {"n_layers": 2, "d_model": 128, "n_heads": 4, "vocab": 512, "seq": 64, "batch": 4, "rotary": True,
                "hidden": None, "n_experts": 8, "top_k": 2, "checkpointing": "none"},
    "t5": {"n_layers": 2, "d_model": 128, "n_heads": 4, "vocab": 512, "seq": 64, "batch": 4, "hidden": None,
           "dropout": 0.1},
    "vit": {"n_layers": 2, "d_model": 128, "n_heads": 4, "n_classes": 10, "image": 32, "patch": 8, "channels": 3,
            "batch": 4, "dropout": 0.0},
    "convnet": {"n_layers": 2, "width": 32, "n_classes": 10, "image": 32, "channels": 3, "batch": 8, "stages": 4,
                "norm": "group"},
}

NAMES = tuple(DEFAULTS)


def _identity(output):
    return output


def build(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
          **config):
    """``(model, example_inputs, loss_fn)`` for model ``name`` with ``config`` overriding :data:`DEFAULTS`.

    The model (``dtype``, on ``device``) returns its loss when called as
    ``model(*example_inputs)``; ``loss_fn(output)`` is the identity. Seeded, so
    two calls with the same arguments build the same model and inputs.

    >>> model, inputs, _ = build("convnet", n_layers=1, width=8, batch=2)
    >>> [tuple(t.shape) for t in inputs]
    [(2, 3, 32, 32), (2,)]
    """
    if name not in DEFAULTS:
        raise ValueError(f"unknown model {name!r} (choose from {', '.join(NAMES)})")
    unknown = set(config) - set(DEFAULTS[name])
    if unknown:
        raise ValueError(f"unknown option(s) for {name}: {', '.join(sorted(unknown))}")
    cfg: dict[str, Any] = {**DEFAULTS[name], **config}
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    batch = cfg.pop("batch")
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    if name == "gpt":
        model = GPT(**cfg)
        idx = torch.randint(0, cfg["vocab"], (batch, cfg["seq"]), generator=generator)
        targets = torch.randint(0, cfg["vocab"], (batch, cfg["seq"]), generator=generator)
        inputs = (idx, targets)
    elif name in ("llama", "mixtral"):
        model = Llama(**cfg)
        idx = torch.randint(0, cfg["vocab"], (batch, cfg["seq"]), generator=generator)
        targets = torch.randint(0, cfg["vocab"], (batch, cfg["seq"]), generator=generator)
        inputs = (idx, targets)
    elif name == "t5":
        model = T5(**cfg)
        src, tgt_in, targets = (torch.randint(0, cfg["vocab"], (batch, cfg["seq"]), generator=generator)
                                for _ in range(3))
        inputs = (src, tgt_in, targets)
    else:
        model = ConvNet(**cfg) if name == "convnet" else ViT(**cfg)
        images = torch.randn(batch, cfg["channels"], cfg["image"], cfg["image"], generator=generator)
        labels = torch.randint(0, cfg["n_classes"], (batch,), generator=generator)
        inputs = (images.to(dtype), labels)
    model = model.to(device=device, dtype=dtype)
    inputs = tuple(t.to(device) for t in inputs)
    return model, inputs, _identity


def resume(path, model: nn.Module, optimizer, generator: torch.Generator) -> int:
    """``--resume``: load the checkpoint at ``path`` into the model, optimizer and data generator; its step."""
    from dcsched.train.checkpoint import load_checkpoint
    extra = load_checkpoint(path, model, optimizer)
    generator.set_state(extra["data"])
    return int(extra["step"])


def checkpoint(path, model: nn.Module, optimizer, generator: torch.Generator, step: int) -> None:
    """``--save``: checkpoint the model, optimizer and data generator at ``path``, taken after ``step`` steps."""
    from dcsched.train.checkpoint import save_checkpoint
    save_checkpoint(path, model, optimizer, extra={"step": step, "data": generator.get_state()})
