"""selection.py, the trainer's prompt selection: whole groups of candidates kept in TRL's batch shapes, the rule's
choice (highest predicted spread; importance draws whose weights multiply the advantages), random until the probe is
trusted, the prefill that pools what the training pass pools, and draws that resume bit for bit."""

import math
from dataclasses import replace

import pytest
import torch

from poise_trl import POISETrainer
from poise_trl.estimator.buffer import prompt_group_ids
from poise_trl.estimator.estimator import POISEEstimator
from poise_trl.grpo.step import GenerationStep

from .conftest import digit_dataset, digit_reward, poise_args, spy_batch_advantages
from .scenarios.test_beyond_paper import G, Recording, _logged
from .tiny_archs import SpyTrainer


def test_value_selection_keeps_whole_groups_and_trl_batch_shapes(tiny_model_path, tmp_path):
    """Two gradient-accumulation steps per generation, 4 rows each: 8 rows (4 prompts) kept of 8 candidates."""
    args = poise_args(
        tmp_path,
        max_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        prompt_selection="value",
        prompt_selection_oversample=2.0,
    )
    trainer = Recording(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    trainer.train()
    tokenizer = trainer.processing_class
    assert trainer.selection_candidates == 8
    for record in trainer.records:
        assert len(record["candidates"]) == 16
        output = record["output"]
        assert record["advantages"].shape == (8,) and output["prompt_ids"].size(0) == 8
        ids, mask = output["prompt_ids"], output["prompt_mask"].bool()
        kept = [tokenizer.decode(ids[i][mask[i]]) for i in range(8)]
        assert kept[0::2] == kept[1::2]  # whole groups, consecutive
        assert set(kept) <= set(record["candidates"]) and len(set(kept)) == 4
    assert _logged(trainer, "poise/selection/random") == [1.0, 0.0, 0.0]
    assert _logged(trainer, "poise/selection/kept_fraction") == [0.5] * 3
    spread, candidates = (
        _logged(trainer, "poise/selection/predicted_spread"),
        _logged(trainer, "poise/selection/candidate_spread"),
    )
    # Undefined on the random first step, so absent from its log line (docs/metrics.md).
    assert "poise/selection/predicted_spread" not in trainer.state.log_history[0] and len(spread) == 2
    assert all(s >= c for s, c in zip(spread, candidates, strict=True))
    tokens = _logged(trainer, "poise/selection/prefill_tokens")
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in trainer.records[1]["candidates"][::G])
    assert tokens[0] == 0 and tokens[1] == prompt_tokens
    for key in ("reward_variance", "degenerate_fraction"):
        assert all(v is not None for v in _logged(trainer, f"poise/selection/{key}"))


def test_selection_keeps_the_highest_predicted_spread(tiny_model_path, tmp_path, monkeypatch):
    args = poise_args(tmp_path, prompt_selection="value", per_device_train_batch_size=4)
    trainer = POISETrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    values = torch.tensor([0.0, 0.9, 0.5, 1.0, 0.4, 0.2])  # p(1-p): 0, .09, .25, 0, .24, .16 -> keep 2 and 4
    trainer.model.train()
    monkeypatch.setattr(POISEEstimator, "trusted_", property(lambda self: True))
    trainer.estimator.prompt_values = lambda states, prompt_ids: states
    trainer.estimator.target_range = lambda: (torch.tensor(0.0), torch.tensor(1.0))
    trainer._prefill_prompts = lambda prompts: (values[: len(prompts)], 7)
    inputs = [{"prompt": f"p{i}"} for i in range(6) for _ in range(G)]
    kept = trainer._select_prompts(inputs, GenerationStep("train", "loss"))
    assert [x["prompt"] for x in kept] == ["p2", "p2", "p4", "p4"]
    with pytest.raises(RuntimeError, match="whole groups"):
        trainer._select_prompts(inputs[1:], GenerationStep("train", "loss"))


def test_importance_weights_multiply_the_advantages_of_the_drawn_rows(tiny_model_path, tmp_path, monkeypatch):
    """The trainer hands each kept row its prompt's weight: its advantages are the unweighted ones times the weight,
    and TRL's batch carries them (before its shuffle), while the probe learns from the plain rewards."""
    args = poise_args(
        tmp_path, max_steps=3, per_device_train_batch_size=4, prompt_selection="importance", probe_warmup_steps=1
    )
    trainer = Recording(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    calls = []
    advantages = trainer.estimator.advantages

    def recorded(args, kwargs, result):
        features, rollouts = args
        plain = advantages(features, replace(rollouts, weights=None), **kwargs).advantages
        calls.append((rollouts.weights, plain, result.advantages))

    spy_batch_advantages(trainer, monkeypatch, recorded)
    trainer.train()
    assert calls[0][0].tolist() == [1.0] * 4  # uniform until the probe is trusted
    assert any(weights.tolist() != [1.0] * 4 for weights, _, _ in calls[1:])
    for (weights, plain, weighted), record in zip(calls, trainer.records, strict=True):
        torch.testing.assert_close(weighted, plain * weights.to(plain.dtype))
        torch.testing.assert_close(record["advantages"], weighted)
    logged = _logged(trainer, "poise/selection/weight_max")
    assert logged == [max(weights.tolist()) for weights, _, _ in calls]


def test_random_fallback_before_the_probe_is_trusted(tiny_model_path, tmp_path):
    args = poise_args(tmp_path, prompt_selection="value", per_device_train_batch_size=4, probe_warmup_steps=100)
    trainer = POISETrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    trainer.model.train()
    assert trainer.estimator.prompt_values(torch.zeros(16, 128)) is None
    inputs = [{"prompt": f"p{i}"} for i in range(8) for _ in range(G)]
    kept = []
    for step in range(50):  # random draws are seeded by the steps the estimator observed
        trainer.estimator.state_ = replace(trainer.estimator.state_, steps=step)
        drawn = trainer._select_prompts(inputs, GenerationStep("train", "loss"))
        kept.append(tuple(x["prompt"] for x in drawn)[::G])
    counts = torch.tensor([sum(f"p{i}" in k for k in kept) for i in range(8)], dtype=torch.float)
    assert len(set(kept)) > 10  # random, not always the same half
    assert counts.min() > 5  # every candidate is kept sometimes (expected 12.5 times each)


def test_the_prefill_pools_the_prompt_states_the_training_pass_pools(tiny_model_path, tmp_path):
    """Selection scores prompts from a prompt-only prefill it pads itself: its pooled states must be the training
    pass's prompt block for the same prompts (up to rounding: a prompt's states move with the batch's padding)."""

    class Capture(SpyTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            prompts = [x["prompt"] for x in inputs][::G]
            self.prefilled.append(self._prefill_prompts(prompts))  # at this step's weights
            return output

    args = poise_args(tmp_path, max_steps=2, probe_features=["prompt", "reasoning"], probe_partner_reward=False)
    trainer = Capture(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    trainer.prefilled = []
    trainer.train()
    start, stop = trainer.estimator.spec.prompt.columns
    for scored, (states, tokens) in zip(trainer.scored, trainer.prefilled, strict=True):
        features = scored["features"]
        expected = features[::G, trainer.estimator.layer_index_, start:stop]
        assert states.shape == expected.shape and tokens > 0
        torch.testing.assert_close(states, expected, atol=1e-5, rtol=1e-5)


def test_selection_after_a_warm_start_uses_the_probe_from_the_first_step(tiny_model_path, tmp_path):
    first = POISETrainer(
        str(tiny_model_path), digit_reward, args=poise_args(tmp_path, max_steps=2), train_dataset=digit_dataset()
    )
    first.train()
    first.save_probe(tmp_path / "probe.safetensors")
    args = poise_args(
        tmp_path,
        max_steps=1,
        per_device_train_batch_size=4,
        prompt_selection="value",
        probe_warmup_steps=100,
        probe_init_path=str(tmp_path / "probe.safetensors"),
    )
    warm = POISETrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    warm.train()
    assert _logged(warm, "poise/selection/random") == [0.0]
    assert not math.isnan(_logged(warm, "poise/selection/predicted_spread")[0])


def test_the_random_selection_phase_resumes_bit_for_bit(tiny_model_path, tmp_path):
    selection = dict(prompt_selection="value", per_device_train_batch_size=4, probe_warmup_steps=100)
    uninterrupted, resumed = _resumed_selection(tiny_model_path, tmp_path, selection)
    assert _logged(uninterrupted, "poise/selection/random") == [1.0] * 4
    assert len(resumed.kept) == 2
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted.kept[2:], resumed.kept, strict=True))


@pytest.mark.parametrize("history", [False, True])
def test_the_importance_sampler_resumes_its_draws_and_weights_bit_for_bit(tiny_model_path, tmp_path, history):
    """With the prompt history, 8 prompts so that they repeat: q reads each candidate's history, which the checkpoint
    restores."""
    selection = dict(
        prompt_selection="importance", per_device_train_batch_size=4, probe_warmup_steps=1, probe_history=history
    )
    prompts = digit_dataset(8 if history else 64)
    uninterrupted, resumed = _resumed_selection(tiny_model_path, tmp_path, selection, prompts)
    if history:
        counts = uninterrupted.estimator.prompt_history_.lookup(prompt_group_ids(prompts["prompt"]))[1]
        assert counts.max() > G  # a prompt kept at two steps
        tables = [run.estimator.state_dict()["tensors"] for run in (uninterrupted, resumed)]
        assert all(torch.equal(tables[0][k], tables[1][k]) for k in tables[0] if k.startswith("history."))
    assert _logged(uninterrupted, "poise/selection/random") == [1.0, 0.0, 0.0, 0.0]
    weight_max = _logged(uninterrupted, "poise/selection/weight_max")
    assert _logged(resumed, "poise/selection/weight_max") == weight_max and set(weight_max[2:]) != {1.0}
    for name in ("kept", "advantages"):  # the same prompts drawn, the same weights on their advantages
        pairs = zip(getattr(uninterrupted, name)[2:], getattr(resumed, name), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs), name


class KeptPrompts(SpyTrainer):
    @property
    def kept(self) -> list[torch.Tensor]:
        return [s["output"]["prompt_ids"] for s in self.scored]

    @property
    def advantages(self) -> list[torch.Tensor]:
        return [s["advantages"] for s in self.scored]


def _resumed_selection(model, tmp_path, selection: dict, prompts=None) -> tuple[KeptPrompts, KeptPrompts]:
    """A 4-step run, and the same run resumed from its step-2 checkpoint (on `prompts`, by default 64)."""
    args = poise_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, **selection)
    runs = []
    for checkpoint in (None, str(tmp_path / "out" / "checkpoint-2")):
        run = KeptPrompts(str(model), digit_reward, args=args, train_dataset=prompts or digit_dataset())
        run.train(resume_from_checkpoint=checkpoint)
        runs.append(run)
    return runs[0], runs[1]
