"""A Hugging Face Trainer script as a user writes it (torch_compile=True), GPT-2 from a config.

Prints one JSON line per logged step (loss, grad_norm) on rank 0; run it plainly, under torchrun (accelerate
wraps the model in DDP) and under ``dcsched train``.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_models  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

model = hf_models.build("gpt2")
data = [{"input_ids": batch["input_ids"][i], "labels": batch["labels"][i]}
        for batch in hf_models.batches("gpt2", 4) for i in range(hf_models.BATCH)]
args = TrainingArguments(output_dir=sys.argv[1], torch_compile=True, max_steps=4, per_device_train_batch_size=2,
                         learning_rate=1e-3, max_grad_norm=0.5, report_to=[], save_strategy="no", logging_steps=1,
                         use_cpu=True, seed=0, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
if int(os.environ.get("RANK", "0")) == 0:
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print("logged", json.dumps({"loss": entry["loss"], "grad_norm": entry["grad_norm"]}))
