"""Beyond the paper on the tiny model: the partner-aware probe and the shrunk bootstrap (prompt selection:
test_selection.py)."""

import copy

import pytest
import torch

from poise_trl import POISETrainer
from poise_trl.estimator.baselines import leave_one_out_targets, shrunk_rloo_line
from poise_trl.estimator.files import read_state

from ..conftest import digit_dataset, digit_reward, poise_args
from ..tiny_archs import SpyTrainer

G = 2


class Recording(SpyTrainer):
    """Records each scoring step's candidate prompts; `SpyTrainer` adds the kept output, the gathered rewards, the
    logged baselines and POISE's advantages (`records`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.candidates: list[list] = []

    def _generate_and_score_completions(self, inputs):
        if self.model.training:
            self.candidates.append([x["prompt"] for x in inputs])
        return super()._generate_and_score_completions(inputs)

    @property
    def records(self) -> list[dict]:
        return [{"candidates": c, **s} for c, s in zip(self.candidates, self.scored, strict=True)]


def _logged(trainer, key: str) -> list:
    return [h[key] for h in trainer.state.log_history if key in h]


# ---------------------------------------------------------------------------------------------- partner-aware probe
def test_a_rollouts_reward_moves_its_partners_baseline_and_never_its_own(tiny_model_path, tmp_path):
    """Score one batch twice from the same probe state and sampling seed, the second time with rollout 0's reward
    raised: only its partner's baseline may move (b_1 = h(φ_0, r_0)); rollout 0's own baseline must not."""
    # The batch is scored by hand, outside a training step: POISE's own pass gives its features while it is scored.
    args = poise_args(
        tmp_path, max_steps=2, probe_partner_reward=True, probe_clip_range=[-10.0, 10.0], probe_capture="pass"
    )
    trainer = POISETrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    trainer.train()
    assert trainer.estimator.probes_["default"].trusted
    assert trainer.estimator.probes_["default"].buffer.features.size(-1) == 2 * 128 + 3 + 1  # [φ | r]
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
        torch.testing.assert_close(record["advantages"], record["rewards"] - record["baselines"])
        assert _logged(trainer, "poise/bootstrap_weight")[step] == pytest.approx(weight)


def test_resume_restores_the_shrunk_bootstrap_bit_for_bit(tiny_model_path, tmp_path):
    """Defaults (partner-aware probe, shrunk bootstrap) still in the bootstrap at the resumed step."""
    overrides = dict(probe_partner_reward=True, probe_bootstrap="shrunk", probe_warmup_steps=5)
    args = poise_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=3, **overrides)
    uninterrupted = Recording(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    uninterrupted.train()
    resumed = Recording(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    assert len(resumed.estimator.bootstrap_pairs_["default"]) == 4 * 8
    before, after = uninterrupted.records[3], resumed.records[0]
    assert torch.equal(before["baselines"], after["baselines"])
    assert _logged(resumed, "poise/bootstrap_weight")[-1] == _logged(uninterrupted, "poise/bootstrap_weight")[-1] != 1
