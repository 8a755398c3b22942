"""Real models captured as bundles, to check which ops they use: dcsched's examples and the Hugging Face models
of ``hf_models`` (built from configs, nothing downloaded). Used by ``tests/test_allowed_ops.py`` and by
``tools/allowed_ops.py``, which fails if one of them uses an op the allow-list's rules refuse.
"""

from __future__ import annotations

import torch

import dcsched
from dcsched.examples import build
from dcsched.graph.roles import qualified_name

_SMALL = dict(n_layers=1, d_model=16, n_heads=2, vocab=32, seq=8, batch=2)
#: dcsched's example models, small, in training mode: label -> (model name, options).
EXAMPLES = {
    "gpt": ("gpt", {**_SMALL, "dropout": 0.1}),
    "llama": ("llama", _SMALL),
    "mixtral": ("mixtral", _SMALL),
    "t5": ("t5", _SMALL),
    "vit": ("vit", {"n_layers": 1, "d_model": 16, "n_heads": 2, "image": 16, "patch": 8, "batch": 2}),
    "convnet": ("convnet", {"n_layers": 2, "width": 8, "image": 8, "batch": 2}),
    "convnet-bn": ("convnet", {"n_layers": 1, "width": 8, "image": 8, "batch": 2, "norm": "batch"}),
}
#: The Hugging Face models of ``hf_models``; Mixtral in bfloat16, whose experts are then ``aten._grouped_mm``
#: (in float32 transformers routes them through its own op, which a bundle does not hold).
HF_MODELS = ("gpt2", "llama", "mixtral", "t5", "bert", "vit")


def capture_example(label: str) -> dcsched.Bundle:
    name, options = EXAMPLES[label]
    model, inputs, loss_fn = build(name, **options)
    return dcsched.capture(model.train(), inputs, loss_fn=loss_fn)


class _Loss(torch.nn.Module):
    """A Hugging Face model called with its batch's keywords, returning its loss."""

    def __init__(self, model: torch.nn.Module, keys: list[str]):
        super().__init__()
        self.model = model
        self.keys = keys

    def forward(self, *values):
        return self.model(**dict(zip(self.keys, values))).loss


def capture_hf(name: str) -> dcsched.Bundle:
    import hf_models
    model = hf_models.build(name).train()
    # GPT-2's config names no loss type, and the warning transformers logs about it breaks the graph.
    model.loss_type = "ForCausalLM" if name == "gpt2" else getattr(model, "loss_type", None)
    batch = hf_models.batches(name, 1)[0]
    if name == "mixtral":
        model = model.to(torch.bfloat16)
    return dcsched.capture(_Loss(model, list(batch)), list(batch.values()))


def ops_of(bundle: dcsched.Bundle) -> set[str]:
    """The qualified names of the ops ``bundle``'s graphs call."""
    return {qualified_name(node.target) for graph in bundle.graphs.values() for node in graph.nodes
            if node.op == "call_function"}
