"""Tiny local models of several architectures (hidden size 8-16, no hub; built by `poise_trl.tiny`) and a trainer
that records what POISE computed next to what TRL's loss received, for the drop-in tests (`test_grpo_parity`,
`test_training_options`, `test_tools`, `test_vision`)."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerFast, Qwen3ForSequenceClassification

from poise_trl import POISETrainer, tiny

# Chat and tool markup are single tokens, as in Qwen3's vocabulary; everything else is one token per character.
SPECIAL = ("<pad>", "<|im_end|>", "<unk>")
MARKUP = ("<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"
PLAIN_TEMPLATE = tiny.PLAIN_TEMPLATE


def char_tokenizer(chat_template: str = PLAIN_TEMPLATE, extra_tokens: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A character tokenizer whose chat/tool markup are single added tokens; `</think>` is one token."""
    return tiny.char_tokenizer(ALPHABET, SPECIAL, (*MARKUP, *extra_tokens), chat_template)


def causal_lm(arch: str, vocab_size: int, hidden_size: int = 16, num_layers: int = 2, seed: int = 0):
    """A tiny causal LM of `arch` built from its config: dense (Qwen3, Llama) or mixture-of-experts (Qwen3-MoE,
    Mixtral, 4 experts, top-2); 2048 positions, as a tool schema in the system prompt is ~600 characters."""
    return tiny.causal_lm(arch, vocab_size, hidden_size, num_layers, 2, 1, max_positions=2048, seed=seed)


def save_causal_lm(path: Path, arch: str = "qwen3", hidden_size: int = 16, tokenizer=None) -> Path:
    """Save a tiny `arch` model and its tokenizer at `path` (beta > 0 reloads the reference model from there)."""
    tokenizer = tokenizer or char_tokenizer()
    causal_lm(arch, len(tokenizer), hidden_size).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_reward_model(path: Path, hidden_size: int = 8) -> Path:
    """A tiny Qwen3 sequence classifier (one score) and its tokenizer: a reward model with a processing class."""
    tokenizer = char_tokenizer()
    torch.manual_seed(1)
    config = tiny.tiny_config("qwen3", len(tokenizer), hidden_size, 1, 2, 1, num_labels=1)
    Qwen3ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def prompts(n: int = 8, conversational: bool = False) -> Dataset:
    """`n` short distinct prompts, standard or conversational (prompt-only)."""
    texts = [f"{i % 10}{(3 * i) % 10}+{i % 7}" for i in range(n)]
    if conversational:
        return Dataset.from_list([{"prompt": [{"role": "user", "content": t}]} for t in texts])
    return Dataset.from_list([{"prompt": t} for t in texts])


def env_rollout(parts: Callable[[int], list[tuple[str, int]]]) -> Callable:
    """A TRL `rollout_func` whose i-th completion is `parts(i)`: (text, 1) pieces the policy wrote and (text, 0)
    environment feedback (`env_mask` 0), tokenized by the trainer's tokenizer, log-probs 0."""

    def rollout(prompts: list, trainer: Any) -> dict[str, list]:
        encode = lambda text: trainer.processing_class(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
        for i, prompt in enumerate(prompts):
            completion = [(token, keep) for text, keep in parts(i) for token in encode(text)]
            out["prompt_ids"].append(encode(prompt))
            out["completion_ids"].append([token for token, _ in completion])
            out["env_mask"].append([keep for _, keep in completion])
            out["logprobs"].append([0.0] * len(completion))
        return out

    return rollout


def completion_text(completion: Any) -> str:
    """The text of a standard (str) or conversational (list of messages) completion."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content") or "") for message in completion)


def code_reward(completions: list, **kwargs) -> list[float]:
    """A dense, deterministic reward in [0, 1) that differs between almost any two completions of a random model."""
    return [sum(map(ord, completion_text(c))) % 97 / 97 for c in completions]


class SpyTrainer(POISETrainer):
    """Records each training generation batch in `scored`, whichever capture route gave its features: what
    `before_batch` returns when it starts (a subclass's hook: e.g. the probe as it was), its prompts and TRL's output
    as scored, then the features, rewards, baselines and advantages POISE computed once it observed the batch (and
    the estimator's `result` for the batch); and
    every `advantages` tensor TRL's loss received (as the loss read it: on the loss route the loss's own forward
    writes it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outputs: list[dict[str, Any]] = []
        self.observed: list[dict[str, Any]] = []
        self.loss_advantages: list[torch.Tensor] = []

    @property
    def scored(self) -> list[dict[str, Any]]:
        return [{**out, **seen} for out, seen in zip(self.outputs, self.observed, strict=True)]

    def before_batch(self, inputs: list[dict]) -> dict[str, Any]:
        """What to record when a training batch starts, before POISE or TRL touched it."""
        return {}

    def _generate_and_score_completions(self, inputs):
        training = self.model.training
        before = self.before_batch(inputs) if training else {}
        output = super()._generate_and_score_completions(inputs)
        if training:
            tensors = {k: v.clone() for k, v in output.items() if isinstance(v, torch.Tensor)}
            self.outputs.append(dict(before, prompts=[x.get("prompt") for x in inputs], output=tensors))
        return output

    def _observe(self, step):
        divisor = (
            self.estimator.reward_std_.divisor() if self.args.scale_rewards == "batch" else 1.0
        )  # of earlier steps
        features = step.assemble()[0].clone()  # this process's (rows, candidate layers, D)
        result = super()._observe(step)
        if step.mode == "train":
            rows = slice(step.offset, step.offset + step.rows)
            advantages = result.advantages[rows]
            if result.token_advantages is not None:
                advantages = result.token_advantages[rows, : step.spans.completion_mask.size(1)]
            self.observed.append(
                dict(
                    features=features,
                    advantages=advantages.clone(),
                    rewards=step.rollouts.rewards.clone(),
                    baselines=torch.tensor(result.logged_rows()[1][rows]),
                    divisor=divisor,
                    result=result,
                )
            )
        return result

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if self.model.training:
            self.loss_advantages.append(inputs["advantages"].detach().clone())
        return loss


def assert_poise_advantages_reach_the_loss(trainer: SpyTrainer) -> None:
    """Every advantage is POISE's (r - b) / divisor (0 where no baseline), differs from TRL's group-mean advantage
    wherever a group's rewards differ, and TRL's loss received exactly these rows, each used num_iterations times."""
    assert trainer.scored, "no training step was scored"
    for step in trainer.scored:
        rewards, baselines = step["rewards"], step["baselines"]
        expected = torch.where(torch.isfinite(baselines), (rewards - baselines) / step["divisor"], 0.0)
        torch.testing.assert_close(step["advantages"], expected.float(), atol=1e-6, rtol=1e-5)
        grouped = rewards.view(-1, trainer.num_generations)
        group_mean = grouped - grouped.nanmean(1, keepdim=True)
        varied = (grouped.nan_to_num().amax(1) != grouped.nan_to_num().amin(1)).repeat_interleave(
            trainer.num_generations
        )
        if varied.any():  # GRPO's advantage (r - mean) is not what reached the loss
            assert not torch.allclose(step["advantages"][varied], group_mean.flatten()[varied].float())
    produced = torch.cat([s["advantages"] for s in trainer.scored]).repeat(trainer.num_iterations)
    received = torch.cat([a.flatten() for a in trainer.loss_advantages])
    assert torch.equal(produced.sort().values, received.sort().values)
