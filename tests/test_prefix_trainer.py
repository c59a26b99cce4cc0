"""probe_granularity="prefix" in POISETrainer: (B, T) advantages r - V(x, y_<t) reach every TRL loss type, only on
the tokens the policy generated; the probe learns from earlier steps only; PEFT, resume and bad settings."""

import math

import pytest
import torch

from poise_trl import POISEConfig
from poise_trl.estimator import POISEEstimator

from .conftest import short_args
from .test_training_options import LOSS_TYPES
from .tiny_archs import SpyTrainer, code_reward, prompts, save_causal_lm


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_causal_lm(tmp_path_factory.mktemp("prefix") / "qwen3", "qwen3")


class PrefixSpy(SpyTrainer):
    """Also records each training step's estimator result (its per-prefix capture and token advantages)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.results = []
        advantages = self.estimator.advantages

        def spy(*a, **k):
            result = advantages(*a, **k)
            if self.model.training:
                self.results.append(result)
            return result

        self.estimator.advantages = spy


def _train(model_path, tmp_path, steps: int = 3, **overrides) -> PrefixSpy:
    args = short_args(tmp_path, probe_granularity="prefix", max_steps=steps, **overrides)
    trainer = PrefixSpy(str(model_path), code_reward, args=args, train_dataset=prompts())
    trainer.train()
    return trainer


def assert_token_advantages_reach_the_loss(trainer: PrefixSpy) -> None:
    """Before the prefix probe is trusted, (B,) sequence advantages; after, (B, T) ones equal to r - V(x, y_<t) on the
    generated tokens and 0 elsewhere (padding, tool output); TRL's loss received exactly these rows."""
    shapes = [step["advantages"].ndim for step in trainer.scored]
    assert shapes[0] == 1 and 2 in shapes, shapes
    for step, result in zip(trainer.scored, trainer.results, strict=True):
        if step["advantages"].ndim == 1:
            assert result.token_advantages is None
            continue
        prefix, rewards, output = result.prefix, result.batch.rewards, step["output"]
        mask = output["completion_mask"] * output.get("tool_mask", torch.ones_like(output["completion_mask"]))
        width = mask.size(1)
        assert torch.equal(prefix.generated[:, :width], mask.bool())
        expected = torch.where(prefix.generated & result.receives[:, None], rewards[:, None] - prefix.values, 0.0)
        torch.testing.assert_close(step["advantages"], expected[:, :width] / step["divisor"], atol=1e-6, rtol=1e-5)
        assert (step["advantages"][~mask.bool()] == 0).all()
        logged = (step["advantages"] * mask).sum(1) / mask.sum(1).clamp(min=1)  # the row's logged advantage
        torch.testing.assert_close(result.advantages, logged, atol=1e-6, rtol=1e-5)
    produced = torch.cat([s["advantages"].flatten() for s in trainer.scored])
    received = torch.cat([a.flatten() for a in trainer.loss_advantages])
    assert torch.equal(produced.sort().values, received.sort().values)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_trains_with_token_advantages(model_path, tmp_path, loss_type):
    level = "sequence" if loss_type == "luspo" else "token"
    before = None
    trainer = _train(model_path, tmp_path, loss_type=loss_type, importance_sampling_level=level)
    assert_token_advantages_reach_the_loss(trainer)
    for name, parameter in trainer.model.named_parameters():
        before = before or not torch.isfinite(parameter).all()
    assert not before


def test_prefix_metrics_are_logged_and_its_probe_learns_from_earlier_steps(model_path, tmp_path):
    trainer = _train(model_path, tmp_path, steps=3)
    logs = [entry for entry in trainer.state.log_history if "poise/prefix/trusted" in entry]
    assert [entry["poise/prefix/trusted"] for entry in logs] == [0.0, 1.0, 1.0]
    assert all(math.isfinite(v) for entry in logs for k, v in entry.items() if k.startswith("poise/prefix/"))
    assert "poise/prefix/variance_explained" not in logs[0]  # no probe yet: undefined, left out
    assert logs[-1]["poise/prefix/share"] == 1.0
    assert logs[-1]["poise/prefix/buffer_size"] == 3 * 4 * 4  # 3 steps x 4 rollouts x 4 sampled tokens
    # the probe that served step s was fitted on the rows of steps < s: refitting on them gives its values back
    estimator = POISEEstimator(2, **trainer.args.estimator_settings(2, trainer.hidden_size))
    estimator.prefix.buffer.add(*[trainer.results[0].prefix.rows[r] for r in [slice(None)]][0].flatten(0, 1)[None])


def test_peft_and_resume(model_path, tmp_path):
    pytest.importorskip("peft")
