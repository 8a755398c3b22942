"""A Hugging Face Trainer script as a user writes it (torch_compile=True), GPT-2 from a config.

The saving arguments are the defaults: the Trainer checkpoints at the end (``OUTPUT_DIR/checkpoint-4``) on the main
process, and the script then calls ``trainer.save_model()`` on every rank (into ``OUTPUT_DIR``), as scripts do.

``hf_trainer_script.py OUTPUT_DIR PER_DEVICE_BATCH``. Samples are taken in order (``train_sampling_strategy``
sequential), so one process with a batch of 4 and 2 ranks with 2 each train on the same global batches.
Prints one line per logged step (``logged {"loss": ..., "grad_norm": ...}``) on rank 0.
"""

import json
import os
import sys


def main(output_dir: str, per_device_batch: int) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import hf_models
    from transformers import Trainer, TrainingArguments

    model = hf_models.build("gpt2")
    data = [{"input_ids": batch["input_ids"][i], "labels": batch["labels"][i]}
            for batch in hf_models.batches("gpt2", 4) for i in range(hf_models.BATCH)]
    args = TrainingArguments(output_dir=output_dir, torch_compile=True, max_steps=4,
                             per_device_train_batch_size=per_device_batch, train_sampling_strategy="sequential",
                             learning_rate=1e-3, max_grad_norm=0.5, report_to=[], logging_steps=1,
                             use_cpu=True, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model()
    if int(os.environ.get("RANK", "0")) == 0:
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print("logged", json.dumps({"loss": entry["loss"], "grad_norm": entry["grad_norm"]}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
