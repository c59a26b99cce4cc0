"""Run value-guided prompt selection with 1 or 2 CPU processes and dump what each rank chose (launched by tests)."""

import sys

from datasets import Dataset
from rank_io import finish

from poise_trl import POISEConfig, POISETrainer

MODEL, OUT = sys.argv[1], sys.argv[2]
RULE = sys.argv[3] if len(sys.argv) > 3 else "value"
G = 2


def rollout(prompts: list, trainer: POISETrainer) -> dict:
    """Completions that depend only on (prompt, rollout index in its group): fast and deterministic."""
    tokenizer = trainer.processing_class
    prompt_ids, completion_ids = [], []
    for i, prompt in enumerate(prompts):
        prompt_ids.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        text = prompt[::-1][: 2 + i % G] + str(len(prompt) + i % G)
        completion_ids.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def reward(completions: list[str], prompts: list[str], **kwargs) -> list[float]:
    """Prompts of different difficulty: the success rate depends on the prompt, so p(1-p) varies."""
    return [float((len(p) + i) % 3 == 0) for i, p in enumerate(prompts)]


class Recording(POISETrainer):
    def _select_prompts(self, inputs, step):
        kept = super()._select_prompts(inputs, step)
        weights = step.weights.tolist()
        self.steps.append({"candidates": [x["prompt"] for x in inputs], "kept": [x["prompt"] for x in kept]})
        self.steps[-1]["weights"] = weights
        return kept

    def _row_weights(self, step, rows):
        weights = super()._row_weights(step, rows)
        self.steps[-1]["gathered_weights"] = weights.tolist()
        return weights


args = POISEConfig(
    output_dir=OUT,
    per_device_train_batch_size=4,
    max_steps=3,
    logging_steps=1,
    learning_rate=1e-3,
    probe_warmup_steps=1,
    probe_preset="paper",
    probe_pool_tokens=3,
    prompt_selection=RULE,
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,
    seed=0,
)
dataset = Dataset.from_list([{"prompt": f"{i}+{(7 * i) % 13}" + "9" * (i % 4)} for i in range(48)])
trainer = Recording(MODEL, reward, args=args, train_dataset=dataset, rollout_func=rollout)
trainer.steps = []
trainer.train()
logs = [h for h in trainer.state.log_history if "poise/selection/random" in h]
metrics = {k: [h[k] for h in logs] for k in logs[0] if k.startswith("poise/selection/")}
probe = {k: v.flatten().tolist() for k, v in trainer.estimator.probes_["default"].probe.state_dict().items()}
results = {"world": trainer.accelerator.num_processes, "steps": trainer.steps, "metrics": metrics, "probe": probe}
finish(OUT, trainer.accelerator.process_index, results)
