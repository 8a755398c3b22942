"""Hugging Face models built from configs (random init, nothing downloaded), and a training loop over them.

Each model is 2 layers of width 32; T5 and BERT keep their dropout. Every rank is fed the same batches (the
user's habit the multi-rank issue was found with), so a W-rank run must print the losses of one process.
"""

from __future__ import annotations

import torch

VOCAB = 64
SEQ = 8
BATCH = 4
LR = 1e-3
#: clip_grad_norm_'s max_norm: below the gradients' norm, so clipping changes every step.
MAX_NORM = 0.5


def _build(name: str):
    import transformers as hf
    small = dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64, vocab_size=VOCAB)
    if name == "gpt2":
        return hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=16,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if name == "llama":
        return hf.LlamaForCausalLM(hf.LlamaConfig(**small, num_key_value_heads=1, max_position_embeddings=16))
    if name == "mixtral":
        return hf.MixtralForCausalLM(hf.MixtralConfig(**small, num_key_value_heads=1, max_position_embeddings=16,
                                                      num_local_experts=4, num_experts_per_tok=2))
    if name == "t5":
        return hf.T5ForConditionalGeneration(hf.T5Config(d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2,
                                                         vocab_size=VOCAB, dropout_rate=0.1,
                                                         decoder_start_token_id=0))
    if name == "bert":
        return hf.BertForMaskedLM(hf.BertConfig(**small, max_position_embeddings=16, hidden_dropout_prob=0.1,
                                                attention_probs_dropout_prob=0.1))
    if name == "vit":
        return hf.ViTForImageClassification(hf.ViTConfig(**{k: v for k, v in small.items() if k != "vocab_size"},
                                                         image_size=16, patch_size=8, num_labels=4))
    raise KeyError(name)


def build(name: str):
    torch.manual_seed(0)
    model = _build(name)
    model.config.use_cache = False if hasattr(model.config, "use_cache") else None
    return model


def batches(name: str, steps: int) -> list[dict]:
    generator = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        if name == "vit":
            out.append({"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=generator),
                        "labels": torch.randint(0, 4, (BATCH,), generator=generator)})
            continue
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
        labels = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator) if name in ("t5", "bert") else ids
        out.append({"input_ids": ids, "labels": labels})
    return out


def train(name: str, steps: int, algo: str | None = None, clip: bool = False, evaluate: bool = False,
          save: str | None = None, keep_model: bool = False, checkpointing: dict | None = None) -> dict:
    """Losses (and clip norms, evaluation losses) of ``steps`` AdamW steps; ``algo`` None: plain eager.

    With ``algo`` the model is sharded over the process group (if any) and compiled with dcsched's backend and
    its default settings (the measured cost model). ``save``: ``save_pretrained`` there at the end (on every
    rank; rank 0 writes), and ``full_state_dict_matches``: whether torch's ``get_model_state_dict`` with
    full state dicts holds the same full tensors. ``keep_model``: the trained model under ``model``.
    ``checkpointing``: ``gradient_checkpointing_enable``'s ``gradient_checkpointing_kwargs`` (with ``algo``, the
    run's ``collectives`` and ``saved``: the bytes its step saves for the backward, and would without).
    """
    import dcsched
    torch._dynamo.reset()
    model = build(name)
    model.train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    run = model
    backend = None
    if algo is not None:
        dcsched.shard(model)
        backend = dcsched.backend(algo=algo)
        run = torch.compile(model, backend=backend, dynamic=False)
    torch.manual_seed(7)  # dropout draws the same masks in every run
    losses, norms, evaluated = [], [], []
    for batch in batches(name, steps):
        with dcsched.tracing_checkpoints():
            loss = run(**batch).loss
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if evaluate:
            model.eval()
            with torch.no_grad():
                evaluated.append(float(run(**batch).loss))
            model.train()
    result = {"losses": losses, "norms": norms, "evaluated": evaluated}
    if checkpointing is not None and backend is not None:
        from comm_counts import planned_collectives
        from dcsched.runtime.commplan import comm_plan
        program = backend.programs[0]
        result["collectives"] = {
            "graphs": len(backend.programs), "issued": sum(getattr(program.runtime, "issued", {}).values()),
            "planned": planned_collectives(program.bundle.graphs, comm_plan(program.bundle.plans,
                                                                            program.bundle.graph_ids))}
        provenance = program.bundle.provenance  # what the step saves for the backward, and would without
        result["saved"] = (provenance.get("saved_for_backward_bytes"),
                           provenance.get("saved_for_backward_bytes_without_checkpointing"))
    if save is not None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        main = not dist.is_initialized() or dist.get_rank() == 0
        model.save_pretrained(save, is_main_process=main)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        state = model.state_dict()
        result["full_state_dict_matches"] = list(full) == list(state) and all(
            torch.equal(full[k], state[k]) for k in state)
    if keep_model:
        result["model"] = model
    return result
