"""Beyond the paper on the tiny model: partner-aware probe, shrunk bootstrap, value-guided prompt selection."""

import copy

import pytest
import torch

from poise_trl import POISETrainer
from poise_trl.baselines import leave_one_out_targets, shrunk_rloo_line
from poise_trl.estimator import POISEEstimator
from poise_trl.files import read_state

from .conftest import digit_dataset, digit_reward, poise_args, score_and_capture_features

G = 2


class Recording(POISETrainer):
    """Records each scoring step's candidate prompts, kept output, gathered rewards and logged baselines."""

    def _generate_and_score_completions(self, inputs):
        candidates = [x["prompt"] for x in inputs]
        output = super()._generate_and_score_completions(inputs)
        n = output["advantages"].numel()
        self.records.append(
            dict(
                candidates=candidates,
                output={k: v.clone() for k, v in output.items() if isinstance(v, torch.Tensor)},
                rewards=(self._gathered_rewards * self.reward_weights).nansum(1).clone(),
                baselines=torch.tensor(list(self._logs["extra"]["baseline"])[-n:]),
            )
        )
        return output


def _logged(trainer, key: str) -> list:
    return [h[key] for h in trainer.state.log_history if key in h]


# ---------------------------------------------------------------------------------------------- partner-aware probe
def test_a_rollouts_reward_moves_its_partners_baseline_and_never_its_own(tiny_model_path, tmp_path):
    """Score one batch twice from the same probe state and sampling seed, the second time with rollout 0's reward
    raised: only its partner's baseline may move (b_1 = h(φ_0, r_0)); rollout 0's own baseline must not."""
    args = poise_args(tmp_path, max_steps=2, probe_partner_reward=True, probe_clip_range=[-10.0, 10.0])
    trainer = POISETrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    trainer.train()
    assert trainer.probes["default"].trusted
    assert trainer.probe_buffer.features.size(-1) == 2 * 128 + 3 + 1  # [φ | r]
    state = copy.deepcopy(trainer.estimator)
    inputs = [{"prompt": p} for p in ("12+3", "45+6", "78+9", "01+2") for _ in range(G)]
    calculate = trainer._calculate_rewards

    def score(bump: float) -> torch.Tensor:
        trainer.estimator = copy.deepcopy(state)

        def bumped(*args):
            rewards = calculate(*args)
            rewards[0] += bump  # in place: the trainer keeps this very tensor as its gathered rewards
            return rewards

        trainer._calculate_rewards = bumped
        torch.manual_seed(0)
        trainer.model.train()
        trainer._generate_and_score_completions(inputs)
        return torch.tensor(list(trainer._logs["extra"]["baseline"])[-len(inputs) :])

    before, after = score(0.0), score(0.5)
    assert after[0] == before[0]  # its own baseline: bit for bit
    assert abs(after[1] - before[1]) > 1e-4  # the partner's moved with r_0
    assert torch.equal(after[2:], before[2:])  # other groups untouched


def test_probe_files_record_the_partner_reward_setting(tiny_model_path, tmp_path):
    first = POISETrainer(
        str(tiny_model_path),
        digit_reward,
        args=poise_args(tmp_path, max_steps=1, probe_partner_reward=True),
        train_dataset=digit_dataset(),
    )
    first.train()
    first.save_probe(tmp_path / "p.safetensors")
    info = read_state(tmp_path / "p.safetensors")["info"]
    assert info["feature_config"]["probe_partner_reward"] is True
    with pytest.raises(ValueError, match="probe_partner_reward"):
        POISETrainer(
            str(tiny_model_path),
            digit_reward,
            args=poise_args(tmp_path, probe_partner_reward=False, probe_init_path=str(tmp_path / "p.safetensors")),
            train_dataset=digit_dataset(),
        )


# ------------------------------------------------------------------------------------------------ shrunk bootstrap
def test_shrunk_bootstrap_uses_a_line_fitted_on_earlier_steps_only(tiny_model_path, tmp_path):
    args = poise_args(tmp_path, max_steps=3, probe_warmup_steps=10, probe_bootstrap="shrunk")
    trainer = Recording(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    trainer.records = []
    trainer.train()
    assert _logged(trainer, "poise/bootstrap_weight")[0] == 1.0  # no history: plain RLOO
    assert _logged(trainer, "poise/bootstrap_intercept")[0] == 0.0
    for step, record in enumerate(trainer.records):
        rloo = leave_one_out_targets(record["rewards"], G)
        intercept, weight = 0.0, 1.0
        if step:
            earlier = torch.cat([r["rewards"] for r in trainer.records[:step]])
            intercept, weight = shrunk_rloo_line(leave_one_out_targets(earlier, G), earlier).tolist()
        torch.testing.assert_close(record["baselines"], (intercept + weight * rloo).float())
        torch.testing.assert_close(record["output"]["advantages"], record["rewards"] - record["baselines"])
        assert _logged(trainer, "poise/bootstrap_weight")[step] == pytest.approx(weight)


def test_resume_restores_the_shrunk_bootstrap_bit_for_bit(tiny_model_path, tmp_path):
    """Defaults (partner-aware probe, shrunk bootstrap) still in the bootstrap at the resumed step."""
    overrides = dict(probe_partner_reward=True, probe_bootstrap="shrunk", probe_warmup_steps=5)
    args = poise_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=3, **overrides)
    uninterrupted = Recording(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    uninterrupted.records = []
    uninterrupted.train()
    resumed = Recording(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    resumed.records = []
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    assert len(resumed.bootstrap_pairs["default"]) == 4 * 8
    before, after = uninterrupted.records[3], resumed.records[0]
    assert torch.equal(before["baselines"], after["baselines"])
    assert _logged(resumed, "poise/bootstrap_weight")[-1] == _logged(uninterrupted, "poise/bootstrap_weight")[-1] != 1


# ------------------------------------------------------------------------------------------------ prompt selection
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
    trainer.records = []
    trainer.train()
    tokenizer = trainer.processing_class
    assert trainer.selection_candidates == 8
    for record in trainer.records:
        assert len(record["candidates"]) == 16
        output = record["output"]
        assert output["advantages"].shape == (8,) and output["prompt_ids"].size(0) == 8
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
    monkeypatch.setattr(POISEEstimator, "trusted", property(lambda self: True))
    trainer.estimator.prompt_values = lambda states: states
    trainer.estimator.target_range = lambda: (torch.tensor(0.0), torch.tensor(1.0))
    trainer._prefill_prompts = lambda prompts: (values[: len(prompts)], 7)
    inputs = [{"prompt": f"p{i}"} for i in range(6) for _ in range(G)]
    kept = trainer._select_prompts(inputs)
    assert [x["prompt"] for x in kept] == ["p2", "p2", "p4", "p4"]
    with pytest.raises(RuntimeError, match="whole groups"):
        trainer._select_prompts(inputs[1:])


def test_importance_weights_multiply_the_advantages_of_the_drawn_rows(tiny_model_path, tmp_path, monkeypatch):
    """The trainer hands each kept row its prompt's weight: its advantages are the unweighted ones times the weight,
    and TRL's batch carries them (before its shuffle), while the probe learns from the plain rewards."""
    args = poise_args(
        tmp_path, max_steps=3, per_device_train_batch_size=4, prompt_selection="importance", probe_warmup_steps=1
    )
    trainer = Recording(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    trainer.records, calls = [], []
    advantages = trainer.estimator.advantages

    def recorded(*args, weights=None, **kwargs):
        result = advantages(*args, weights=weights, **kwargs)
        calls.append((weights, advantages(*args, **kwargs).advantages, result.advantages))
        return result

    monkeypatch.setattr(trainer.estimator, "advantages", recorded)
    trainer.train()
    assert calls[0][0].tolist() == [1.0] * 4  # uniform until the probe is trusted
    assert any(weights.tolist() != [1.0] * 4 for weights, _, _ in calls[1:])
    for (weights, plain, weighted), record in zip(calls, trainer.records, strict=True):
        torch.testing.assert_close(weighted, plain * weights.to(plain.dtype))
        torch.testing.assert_close(record["output"]["advantages"], weighted)
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
        trainer.estimator.steps = step
        kept.append(tuple(x["prompt"] for x in trainer._select_prompts(inputs))[::G])
    counts = torch.tensor([sum(f"p{i}" in k for k in kept) for i in range(8)], dtype=torch.float)
    assert len(set(kept)) > 10  # random, not always the same half
    assert counts.min() > 5  # every candidate is kept sometimes (expected 12.5 times each)


def test_the_prefill_pools_the_prompt_states_the_training_pass_pools(tiny_model_path, tmp_path):
    """Selection scores prompts from a prompt-only prefill it pads itself: its pooled states must be the training
    pass's prompt block for the same prompts (up to rounding: a prompt's states move with the batch's padding)."""

    class Capture(POISETrainer):
        def _generate_and_score_completions(self, inputs):
            output, features = score_and_capture_features(self, super()._generate_and_score_completions, inputs)
            prompts = [x["prompt"] for x in inputs][::G]
            self.captured.append((features, *self._prefill_prompts(prompts)))  # at this step's weights
            return output

    args = poise_args(tmp_path, max_steps=2, probe_features=["prompt", "reasoning"], probe_partner_reward=False)
    trainer = Capture(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    trainer.captured = []
    trainer.train()
    start, stop = trainer.estimator.prompt_columns
    for features, states, tokens in trainer.captured:
        expected = features[::G, trainer.estimator.layer_index, start:stop]
        assert states.shape == expected.shape and tokens > 0
        torch.testing.assert_close(states, expected, atol=1e-5, rtol=1e-5)
