"""POISE per-prefix + the importance sampler on CUDA (bf16, gradient checkpointing): 4 steps, then the checks."""
import json
import math
import sys

import torch

from poise_lab.bench.overhead.timing import any_text_reward
from poise_lab.tasks.arith import make_arith_splits
from poise_trl import POISEConfig, POISETrainer

model, out = sys.argv[1], sys.argv[2]
cuda = torch.cuda.is_available()
args = POISEConfig(
    output_dir=out, max_steps=4, per_device_train_batch_size=32, max_completion_length=128, learning_rate=1e-5,
    probe_granularity="prefix", prompt_selection="importance", probe_warmup_steps=1, logging_steps=1,
    report_to="none", save_strategy="no", bf16=cuda, use_cpu=not cuda, gradient_checkpointing=cuda,
)
train = make_arith_splits(2000, seed=0)[0]
trainer = POISETrainer(model=model, reward_funcs=any_text_reward, args=args, train_dataset=train)
trainer.train()
logs = [h for h in trainer.state.log_history if "loss" in h]
keys = ["loss", "poise/prefix/trusted", "poise/prefix/share", "poise/prefix/variance_explained",
        "poise/selection/weight_mean", "poise/selection/weight_max", "poise/variance_reduction"]
table = [{k: h.get(k) for k in ["step", *keys]} for h in logs]
print(json.dumps(table, indent=1))
later = logs[1:]
assert all(math.isfinite(h["loss"]) for h in logs), "a loss is not finite"
assert all(h["poise/prefix/trusted"] == 1.0 and h["poise/prefix/share"] > 0 for h in later), "prefix not served"
assert all(math.isfinite(h["poise/selection/weight_max"]) for h in later), "importance weights not finite"
print("device", trainer.accelerator.device, "dtype", next(trainer.model.parameters()).dtype,
      "peak GiB", torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
print("TRAIN CHECK OK")
