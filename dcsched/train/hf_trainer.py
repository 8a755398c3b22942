"""The Hugging Face Trainer's saving under ``dcsched train``: every rank joins the full-weight gather.

The Trainer saves its model (``save_model``: at each ``save_steps``, at the
end of training under the default ``save_strategy="steps"``, and when a
script calls ``trainer.save_model()``) on the main process alone: its
``_save`` returns at once on the other ranks. A dcsched-sharded model's
``state_dict()`` gathers the full weights from every rank
(:mod:`dcsched.train.full_state`), a collective, so the main process would
wait for ranks that never come. Accelerate solves the same problem for FSDP's
full state dicts by gathering in ``save_model`` on every rank and handing the
result to ``_save``; :func:`saving_on_every_rank` makes the Trainer do that
for a model dcsched sharded: every rank calls ``state_dict()`` (the gather),
and the main process writes it (``_save(output_dir, state_dict=...)``).

``save_model`` is already called on every rank (``_save_checkpoint`` runs on
all of them, and a script calls ``trainer.save_model()`` on all of them as
it would for DDP), so nothing changes in the script. The patch lives for one
script run; a model that is not sharded, or one process, saves as the
Trainer does.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from dcsched.train.sharding import sharding_of

_ORIGINAL = "_dcsched_original_save_model"


def _sharded_over_ranks(model) -> bool:
    """Whether ``model`` (or the module a compile or DDP wraps) is sharded by dcsched over several ranks."""
    for candidate in (model, getattr(model, "_orig_mod", None), getattr(model, "module", None)):
        sharding = sharding_of(candidate) if candidate is not None else None
        if sharding is not None:
            return sharding.world_size > 1
    return False


def _save_model(original):
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False) \
                or not _sharded_over_ranks(self.model):
            return original(self, output_dir, _internal_call)
        # Every rank gathers (a collective); _save writes on the main process and returns on the others.
        state_dict = self.model.state_dict()
        self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    save_model.__wrapped__ = original
    return save_model


def patch_loaded_trainer() -> None:
    """Make the Trainer's ``save_model`` gather on every rank, if the script has loaded ``transformers.trainer``.

    Idempotent; :func:`saving_on_every_rank` undoes it.
    """
    module = sys.modules.get("transformers.trainer")
    trainer = getattr(module, "Trainer", None) if module is not None else None
    if trainer is None or _ORIGINAL in trainer.__dict__:
        return
    original = trainer.__dict__.get("save_model")
    if original is None:
        return
    setattr(trainer, _ORIGINAL, original)
    trainer.save_model = _save_model(original)


@contextlib.contextmanager
def saving_on_every_rank() -> Iterator[None]:
    """Within the block, :func:`patch_loaded_trainer` may patch the Trainer; at its end the patch is undone."""
    try:
        yield
    finally:
        module = sys.modules.get("transformers.trainer")
        trainer = getattr(module, "Trainer", None) if module is not None else None
        if trainer is not None and _ORIGINAL in trainer.__dict__:
            trainer.save_model = trainer.__dict__[_ORIGINAL]
            delattr(trainer, _ORIGINAL)
