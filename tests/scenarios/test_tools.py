"""Tools and environments (the paper's ToolDial domain): multi-turn tool calling (`tools=[...]`), `environment_factory`
with an environment-only dataset (no `prompt` column), and `rollout_func` with `env_mask`.

A random tiny model almost never writes a valid tool call, so generation is replaced by deterministic text that
calls a tool; TRL then really parses the call, runs the tool, appends its result and generates again. Each test
recomputes POISE's features from a plain forward pass, on the tokens the policy generated only, and checks that a
`</think>` inside a tool result or environment feedback does not move the reasoning cut."""

from pathlib import Path

import pytest
import torch
import trl
from datasets import Dataset

from poise_trl import POISEConfig

from ..conftest import short_args
from ..tiny_archs import (
    SpyTrainer,
    assert_poise_advantages_reach_the_loss,
    causal_lm,
    char_tokenizer,
    code_reward,
    env_rollout,
)

POOL = 3
THINK_CALL = (
    '<think>\nab</think>\n\n<tool_call>\n{"name": "read_note", "arguments": {"key": "k"}}\n</tool_call><|im_end|>'
)
THINK_ANSWER = "<think>\nx</think>\n\n7<|im_end|>"
AFTER_TOOL = "8<|im_end|>"  # no marker: the policy's last `</think>` came before the tool result
TOOL_RESULT = "n</think>ote"  # a marker the policy did not write


def read_note(key: str) -> str:
    """Reads a note.

    Args:
        key: The note's key.
    """
    return TOOL_RESULT


class NotesEnv:
    """An environment that owns the prompt (from `reset`) and the reward (1 per note read)."""

    def reset(self, **kwargs) -> str:
        self.reads = 0
        return "Read the note."

    def read_note(self, key: str) -> str:
        """Reads a note.

        Args:
            key: The note's key.
        """
        self.reads += 1
        return TOOL_RESULT

    def get_reward(self) -> float:
        return float(self.reads)


class Recording(SpyTrainer):
    """Also records, at each training step, the probe layer's hidden states and the logits of a plain forward pass
    of the not-yet-updated model; `SpyTrainer` adds the features POISE computed (`records`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forwards: list[dict] = []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], 1)
        mask = torch.cat([output["prompt_mask"], output["completion_mask"]], 1)
        with torch.no_grad():
            out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        self.forwards.append(dict(hidden=out.hidden_states[self.estimator.layer_ + 1], logits=out.logits))
        return output

    @property
    def records(self) -> list[dict]:
        """Per step: TRL's output, the forward's hidden states and logits, and POISE's features at the layer in use."""
        return [
            {**forward, "output": scored["output"], "features": scored["features"][:, self.estimator.layer_index_]}
            for forward, scored in zip(self.forwards, self.scored, strict=True)
        ]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    """A tiny Qwen3 with the Qwen3 chat template (tool calling, response parsing) and a character tokenizer."""
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    tokenizer = char_tokenizer(template)
    path = tmp_path_factory.mktemp("tools") / "qwen3"
    causal_lm("qwen3", len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _silence_experimental(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


def _args(tmp_path, **overrides) -> POISEConfig:
    return short_args(
        tmp_path,
        max_completion_length=96,
        probe_layer=0,  # not the last block, whose output_hidden_states entry is after the final norm
        probe_pool_tokens=POOL,
        probe_preset="paper",
        probe_features=["prompt", "reasoning", "entropy", "length"],
        probe_partner_reward=False,  # the recorded probe inputs are compared with φ alone
        **overrides,
    )


def _scripted_generate(trainer, first_turn: list[str]):
    """Replace `generate`: the first turn writes `first_turn[i]` for row i, every later turn (after a tool result)
    writes AFTER_TOOL. Returns the call log (batch sizes)."""
    tokenizer, calls = trainer.processing_class, []

    def generate(input_ids, **kwargs):
        texts = first_turn if input_ids.size(0) == len(first_turn) else [AFTER_TOOL] * input_ids.size(0)
        calls.append(input_ids.size(0))
        rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        width = max(map(len, rows))
        completion = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, completion.to(input_ids.device)], dim=1)

    trainer.model.generate = generate
    return calls


def _assert_features_use_only_generated_tokens(trainer: Recording, marker_id: int) -> int:
    """Recompute φ per row from the recorded forward pass over the generated tokens only; returns the number of rows
    where a marker outside them comes after the policy's last one (so a mask-blind cut would differ)."""
    moved = 0
    for record in trainer.records:
        out, hidden, logits = record["output"], record["hidden"], record["logits"]
        p_len = out["prompt_ids"].size(1)
        generated_mask = out["completion_mask"] * out.get("tool_mask", torch.ones_like(out["completion_mask"]))
        for i in range(hidden.size(0)):
            generated = generated_mask[i].nonzero().flatten().tolist()
            ids = out["completion_ids"][i].tolist()
            markers = [j for j in generated if ids[j] == marker_id]
            foreign = [
                j for j, v in enumerate(ids) if v == marker_id and j not in generated and out["completion_mask"][i, j]
            ]
            moved += bool(foreign and (not markers or foreign[-1] > markers[-1]))
            reasoning = [j for j in generated if j <= markers[-1]] if markers else generated
            answer = [j for j in generated if j > markers[-1]] if markers else generated[-POOL:]
            log_p = torch.log_softmax(logits[i, p_len - 1 : -1].float(), -1)
            entropy = -(log_p.exp() * log_p).sum(-1)
            prompt_positions = out["prompt_mask"][i].nonzero().flatten()[-POOL:]
            expected = torch.cat(
                [
                    hidden[i, prompt_positions].mean(0),
                    hidden[i, [p_len + j for j in reasoning[-POOL:]]].mean(0),
                    torch.stack([entropy[span].mean() for span in (generated, reasoning, answer)]),
                    torch.tensor([float(len(generated))]),
                ]
            )
            torch.testing.assert_close(record["features"][i], expected, atol=2e-4, rtol=1e-4)
    return moved


def test_multi_turn_tool_calling(tool_model, tmp_path):
    trainer = Recording(
        str(tool_model), code_reward, args=_args(tmp_path), train_dataset=_chat_prompts(), tools=[read_note]
    )
    calls = _scripted_generate(trainer, [THINK_CALL, THINK_ANSWER] * 2)
    trainer.train()
    assert calls == [4, 2, 4, 2]  # per step: the first turn, then the two rows that called the tool
    assert [h["tools/call_frequency"] for h in trainer.state.log_history if "tools/call_frequency" in h] == [0.5, 0.5]
    assert all(r["output"]["tool_mask"].eq(0).any() for r in trainer.records)
    assert _assert_features_use_only_generated_tokens(trainer, trainer.marker_ids[0]) == 4  # 2 tool rows per step
    assert_poise_advantages_reach_the_loss(trainer)


def test_environment_factory_with_an_environment_only_dataset(tool_model, tmp_path):
    """A dict of environments routed by an `environment` column, with no `prompt` column: `reset` supplies the
    prompt, the tools are the environment's methods, `get_reward` the reward."""
    dataset = Dataset.from_list([{"environment": "notes"}] * 4)
    trainer = Recording(
        str(tool_model), None, args=_args(tmp_path), train_dataset=dataset, environment_factory={"notes": NotesEnv}
    )
    _scripted_generate(trainer, [THINK_CALL, THINK_ANSWER] * 2)
    trainer.train()
    rewards = torch.cat([s["rewards"] for s in trainer.scored])
    assert rewards.tolist() == [1.0, 0.0] * 4  # one note read by each tool-calling row
    assert _assert_features_use_only_generated_tokens(trainer, trainer.marker_ids[0]) == 4
    assert_poise_advantages_reach_the_loss(trainer)


def test_rollout_func_with_env_mask(tool_model, tmp_path):
    """A custom rollout whose completions interleave policy tokens and environment feedback (`env_mask` 0)."""

    rollout = env_rollout(
        lambda i: [(f"<think>\n{i}</think>\n\nmove", 1), ("\nfeedback: a</think>b\n", 0), (f"{i % 3}<|im_end|>", 1)]
    )

    dataset = Dataset.from_list([{"prompt": f"q{i}"} for i in range(4)])
    trainer = Recording(
        str(tool_model), code_reward, args=_args(tmp_path), train_dataset=dataset, rollout_func=rollout
    )
    trainer.train()
    assert all(r["output"]["tool_mask"].eq(0).sum() == 4 * 15 for r in trainer.records)  # 15 feedback tokens a row
    assert _assert_features_use_only_generated_tokens(trainer, trainer.marker_ids[0]) == 8  # every row
    assert_poise_advantages_reach_the_loss(trainer)


def _chat_prompts() -> Dataset:
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(4)])
