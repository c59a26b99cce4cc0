"""Run POISE on a deterministic rollout with 1 or 2 CPU processes and dump what each rank saw (launched by tests).

argv: MODEL OUT PER_DEVICE [GRANULARITY [PRESET [CAPTURE]]]; with "prefix" each row's token advantages (its generated
tokens) and the per-prefix probe are recorded too; CAPTURE is `probe_capture` ("auto" by default)."""

import sys

from datasets import Dataset
from rank_io import finish

from poise_trl import POISEConfig, POISETrainer

MODEL, OUT, PER_DEVICE = sys.argv[1], sys.argv[2], int(sys.argv[3])
GRANULARITY = sys.argv[4] if len(sys.argv) > 4 else "sequence"
PRESET = sys.argv[5] if len(sys.argv) > 5 else "paper"
CAPTURE = sys.argv[6] if len(sys.argv) > 6 else "auto"
G = 2


def rollout(prompts: list, trainer: POISETrainer) -> dict:
    """Completions that depend only on (prompt, rollout index in its group), so any process layout sees the same
    global batch. The global row index gives the rollout index because a group's rows are consecutive."""
    tokenizer = trainer.processing_class
    offset = trainer.accelerator.process_index * len(prompts)
    prompt_ids, completion_ids = [], []
    for i, prompt in enumerate(prompts):
        k = (offset + i) % G
        prompt_ids.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        text = prompt[::-1][: 2 + k] + ("</think>" if k == 0 else "") + str(len(prompt) + k)
        completion_ids.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def reward(completions: list[str], **kwargs) -> list[float]:
    return [sum(ch.isdigit() for ch in c) / len(c) for c in completions]


class Recording(POISETrainer):
    def _compute_loss(self, model, inputs):
        """What the loss read: each row's (prompt, completion, advantage), rows sorted, whatever the route's order."""
        loss = super()._compute_loss(model, inputs)
        ids = inputs["prompt_ids"].tolist(), inputs["completion_ids"].tolist(), inputs["advantages"].tolist()
        self.reads.append(sorted(zip(*ids, strict=True)))
        return loss

    def _observe(self, step):
        result = super()._observe(step)
        rows = slice(step.offset, step.offset + step.rows)
        advantages = result.advantages[rows]
        record = {
            "route": step.route,
            "baselines": result.logged_rows()[1],  # every process's rows
            "probe": {
                k: v.flatten().tolist() for k, v in self.estimator.probes_["default"].probe.state_dict().items()
            },
        }
        if result.token_advantages is not None:  # each row's generated tokens, whatever the rank's width
            mask = step.spans.completion_mask.bool()
            tokens = result.token_advantages[rows, : mask.size(1)]
            record["token_advantages"] = [row[m].tolist() for row, m in zip(tokens, mask, strict=True)]
        record["advantages"] = advantages.tolist()
        prefix = self.estimator.token_baseline_
        if prefix.name == "prefix" and prefix.probe.is_fitted:
            record["prefix_probe"] = {k: v.flatten().tolist() for k, v in prefix.probe.state_dict().items()}
        self.steps.append(record)
        return result


args = POISEConfig(
    output_dir=OUT,
    per_device_train_batch_size=PER_DEVICE,
    max_steps=3,
    learning_rate=1e-3,
    probe_warmup_steps=1,
    probe_preset=PRESET,
    probe_pool_tokens=3,
    probe_granularity=GRANULARITY,
    probe_capture=CAPTURE,
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,
    seed=0,
)
dataset = Dataset.from_list([{"prompt": f"{i}+{(7 * i) % 13}"} for i in range(24)])
trainer = Recording(MODEL, reward, args=args, train_dataset=dataset, rollout_func=rollout)
trainer.steps, trainer.reads = [], []
trainer.train()
result = {"world": trainer.accelerator.num_processes, "steps": trainer.steps, "loss_reads": trainer.reads}
finish(OUT, trainer.accelerator.process_index, result)
