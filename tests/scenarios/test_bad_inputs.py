"""The bad-input contract at the trainer level: unscorable, non-finite and masked rows never poison anything."""

import math

import torch
from datasets import Dataset

from poise_trl.features.features import find_decoder_layers

from ..conftest import poise_args
from ..tiny_archs import SpyTrainer


def _dataset(n: int = 64) -> Dataset:
    return Dataset.from_list([{"prompt": f"{i % 10}+{(3 * i) % 10}"} for i in range(n)])


class Recorder(SpyTrainer):
    """Keeps each step's rewards, the advantages POISE gave its rows and the completion mask (`seen`)."""

    @property
    def seen(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return [(s["rewards"], s["advantages"], s["output"]["completion_mask"]) for s in self.scored]


def _train(tiny_model_path, tmp_path, reward, **kwargs) -> Recorder:
    trainer = Recorder(str(tiny_model_path), reward, args=poise_args(tmp_path, **kwargs), train_dataset=_dataset())
    trainer.train()
    for _, advantages, _ in trainer.seen:
        assert torch.isfinite(advantages).all()
    return trainer


def _logged(trainer: Recorder, key: str) -> list:
    return [h[key] for h in trainer.state.log_history if key in h]


def _dense(completions: list[str], **kwargs) -> list[float]:
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def test_none_nan_and_inf_rewards_get_zero_advantage_and_stay_out_of_the_buffer(tiny_model_path, tmp_path):
    def broken(completions, **kwargs):
        values = _dense(completions)
        return [
            None if i % 8 == 0 else float("nan") if i % 8 == 3 else math.inf if i % 8 == 5 else v
            for i, v in enumerate(values)
        ]

    trainer = _train(tiny_model_path, tmp_path, broken)
    for rewards, advantages, _ in trainer.seen:
        bad = ~torch.isfinite(rewards)
        assert bad.sum() == 3 and (advantages[bad] == 0).all()
    # Rows 0, 3, 5 are unscorable; their partners 1, 2, 4 have no leave-one-out target: 2 usable rows per step.
    assert len(trainer.estimator.probes_["default"].buffer) == 4 * 2
    assert torch.isfinite(trainer.estimator.probes_["default"].buffer.targets).all()


def test_non_finite_features_are_dropped_and_counted(tiny_model_path, tmp_path):
    trainer = None

    def overflow(module, args, output):
        """Simulate a bf16 overflow in the hooked layer, only during teacher-forced no-grad passes."""
        hidden = output[0] if isinstance(output, tuple) else output
        if not torch.is_grad_enabled() and hidden.size(1) > 8:
            hidden = hidden.clone()
            hidden[0] = math.inf
        return hidden

    class Overflowing(Recorder):
        def _generate_and_score_completions(self, inputs):
            layer = find_decoder_layers(self.accelerator.unwrap_model(self.model))[self.estimator.layer_]
            handle = layer.register_forward_hook(overflow, prepend=True)
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                handle.remove()

    # POISE's own no-grad pass, where the overflow is simulated: on the loss route the same overflow would reach the
    # loss itself, which is TRL's to handle.
    args = poise_args(tmp_path, max_steps=3, probe_capture="pass")
    trainer = Overflowing(str(tiny_model_path), _dense, args=args, train_dataset=_dataset())
    trainer.train()
    assert _logged(trainer, "poise/feature_rows_dropped") == [1.0, 1.0, 1.0]
    assert (
        len(trainer.estimator.probes_["default"].buffer) == 3 * 7
        and torch.isfinite(trainer.estimator.probes_["default"].buffer.features).all()
    )
    for _, advantages, _ in trainer.seen:
        assert torch.isfinite(advantages).all()


def test_non_binary_rewards_clip_to_the_observed_range(tiny_model_path, tmp_path):
    trainer = _train(tiny_model_path, tmp_path, lambda completions, **kw: [3 * r - 1 for r in _dense(completions)])
    low, high = trainer.estimator.probes_["default"].probe.state_dict()["clip"].tolist()
    targets = trainer.estimator.probes_["default"].buffer.targets
    assert (low, high) == (targets.min().item(), targets.max().item())
    assert low < 0 or high > 1  # really outside [0, 1]


def test_identical_rewards_for_many_steps_stay_finite(tiny_model_path, tmp_path):
    trainer = _train(tiny_model_path, tmp_path, lambda completions, **kw: [1.0] * len(completions), max_steps=6)
    for _, advantages, _ in trainer.seen:
        assert torch.equal(advantages, torch.zeros_like(advantages))
    assert trainer.estimator.probes_["default"].probe.is_fitted


def test_fewer_examples_than_features_and_pca_larger_than_rows_still_fit(tiny_model_path, tmp_path):
    # Step 1 has 8 examples for 2*128+3 features and the release preset asks for 32 + 64 PCA components.
    trainer = _train(tiny_model_path, tmp_path, _dense, probe_preset="release", max_steps=2)
    assert trainer.estimator.probes_["default"].probe.is_fitted and trainer.estimator.probes_[
        "default"
    ].probe.fitted_pca_dims == [16, 16]


def test_truncated_masked_completions_get_zero_advantage_and_never_enter_the_buffer(tiny_model_path, tmp_path):
    trainer = _train(tiny_model_path, tmp_path, _dense, mask_truncated_completions=True, max_completion_length=3)
    masked_total = 0
    for _, advantages, completion_mask in trainer.seen:
        masked = completion_mask.sum(1) == 0
        masked_total += int(masked.sum())
        assert (advantages[masked] == 0).all()
    assert masked_total > 0
    assert len(trainer.estimator.probes_["default"].buffer) <= 4 * 8 - masked_total
