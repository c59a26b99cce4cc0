"""probe_granularity="prefix" in POISETrainer: (B, T) advantages r - V(x, y_<t) reach every TRL loss type, only on
the tokens the policy generated; the probe learns from earlier steps only; PEFT, resume and bad settings."""

from dataclasses import replace

import pytest
import torch

from poise_trl import POISETrainer
from poise_trl.estimator.estimator import POISEEstimator, Rollouts
from poise_trl.estimator.specs import BufferSpec, EstimatorSpec, GranularitySpec, LayerSpec
from poise_trl.features.prefix import PrefixBatch
from poise_trl.grpo.resume import ESTIMATOR_FILE

from ..conftest import short_args
from ..docs.test_docs import documented
from ..tiny_archs import SpyTrainer, code_reward, env_rollout, prompts, save_causal_lm
from .test_training_options import LOSS_TYPES
from .test_vision import _args as vision_args
from .test_vision import _image_prompts as image_prompts
from .test_vision import vlm_path  # noqa: F401 (a fixture)

PREFIX = EstimatorSpec(buffer=BufferSpec(warmup_steps=2), granularity=GranularitySpec("prefix"))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_causal_lm(tmp_path_factory.mktemp("prefix") / "qwen3", "qwen3")


class PrefixSpy(SpyTrainer):
    """Also gives each training step's estimator result (its per-prefix capture and token advantages)."""

    @property
    def results(self) -> list:
        return [s["result"] for s in self.scored]


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
    level = "sequence" if loss_type == "luspo" else "token"  # LUSPO is meant for sequence-level ratios
    trainer = _train(model_path, tmp_path, loss_type=loss_type, importance_sampling_level=level)
    assert_token_advantages_reach_the_loss(trainer)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_chunked_pass_shared_by_several_optimizer_steps(model_path, tmp_path):
    """Two optimizer steps per generation: TRL runs its old-log-prob pass in chunks of 4 rows, and the prefix capture
    rides on it (no pass of POISE's own); each token advantage reaches the loss once."""
    trainer = _train(model_path, tmp_path, steps=6, steps_per_generation=2)
    assert trainer.feature_passes == 0 and len(trainer.scored) == 3
    assert_token_advantages_reach_the_loss(trainer)


def test_prefix_probe_serves_only_fits_of_earlier_steps_and_logs_its_metrics(model_path, tmp_path):
    trainer = _train(model_path, tmp_path, steps=3)
    assert_token_advantages_reach_the_loss(trainer)
    # step 2's values at its sampled tokens are what a probe fitted on step 1's rows alone predicts from its rows
    first, second = trainer.results[0], trainer.results[1]
    keep = first.prefix.sampled & (first.batch.scorable & first.batch.has_completion)[:, None]
    rows = first.prefix.rows[keep]
    probe = trainer.estimator.token_baseline_._head(rows.size(-1))
    probe.fit(rows, first.batch.rewards[:, None].expand_as(keep)[keep])
    k = second.prefix.rows.size(1)
    expected = probe.predict(second.prefix.rows.flatten(0, 1)).view(-1, k)
    torch.testing.assert_close(second.prefix.values.gather(1, second.prefix.tokens), expected, atol=1e-4, rtol=1e-4)
    logs = [entry for entry in trainer.state.log_history if "poise/prefix/trusted" in entry]
    assert [entry["poise/prefix/trusted"] for entry in logs] == [0.0, 1.0, 1.0]
    assert [entry["poise/prefix/share"] for entry in logs] == [0.0, 1.0, 1.0]
    assert "poise/prefix/variance_explained" not in logs[0]  # no probe yet: undefined, left out of the log
    for entry in logs[1:]:
        assert {f"poise/prefix/variance_explained/q{q}" for q in range(1, 5)} <= entry.keys()
    assert [entry["poise/prefix/buffer_size"] for entry in logs] == [16.0, 32.0, 48.0]  # 4 rollouts x 4 tokens
    logged = {key for entry in logs for key in entry if key.startswith("poise/prefix/")}
    assert len(logged) == 8 and all(documented(key) for key in logged), logged  # in docs/metrics.md


def test_peft(model_path, tmp_path):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = short_args(tmp_path, probe_granularity="prefix", max_steps=3)
    trainer = PrefixSpy(str(model_path), code_reward, args=args, train_dataset=prompts(), peft_config=peft_config)
    trainer.train()
    assert_token_advantages_reach_the_loss(trainer)


def test_resume_restores_the_prefix_probe_and_continues_as_the_uninterrupted_run(model_path, tmp_path):
    def run(out, resume=None):
        args = short_args(out, probe_granularity="prefix", max_steps=3, save_strategy="steps", save_steps=1)
        trainer = POISETrainer(str(model_path), code_reward, args=args, train_dataset=prompts())
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "full", resume=str(tmp_path / "full" / "out" / "checkpoint-2"))
    saved = POISEEstimator.from_config(full.args, 2, full.hidden_size)
    saved.load(tmp_path / "full" / "out" / "checkpoint-2" / ESTIMATOR_FILE)
    tokens = saved.token_baseline_
    assert tokens.steps == 2 and len(tokens.buffer) == 32 and tokens.trusted
    a, b = full.estimator.token_baseline_.state_dict(), resumed.estimator.token_baseline_.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_sequence_level_file_loads_into_a_prefix_run(tmp_path):
    sequence = POISEEstimator(2, EstimatorSpec(buffer=BufferSpec(warmup_steps=0)))
    features, rewards = torch.randn(8, 5), torch.rand(8)
    sequence.observe(features=features, rollouts=Rollouts(rewards))
    sequence.save(tmp_path / "old.safetensors")
    prefix = POISEEstimator(2, EstimatorSpec(buffer=BufferSpec(warmup_steps=0), granularity=GranularitySpec("prefix")))
    prefix.load(tmp_path / "old.safetensors")
    tokens = prefix.token_baseline_
    assert not tokens.probe.is_fitted and len(tokens.buffer) == 0 and prefix.steps_ == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(probe_granularity="token"), "probe_granularity='token' is not a baseline granularity"),
        (dict(probe_granularity="prefix", probe_layer="auto"), "needs one fixed probe_layer"),
    ],
)
def test_bad_settings_fail_early(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        short_args(tmp_path, **overrides)


def test_bad_estimator_arguments_fail_early():
    with pytest.raises(ValueError, match="needs one fixed layer"):
        EstimatorSpec(granularity=GranularitySpec("prefix"), layers=LayerSpec(ids=(1, 2)))
    with pytest.raises(ValueError, match=r"GranularitySpec.pca_dims=\(4,\) must be two ints"):
        GranularitySpec("prefix", pca_dims=(4,))


def test_environment_tokens_get_no_baseline(model_path, tmp_path, monkeypatch):
    """A `rollout_func` whose completions interleave policy tokens and environment feedback (`env_mask` 0): the
    feedback tokens get advantage 0 and are never sampled for the probe; the policy's tokens after them get r - V."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")

    rollout = env_rollout(lambda i: [(f"move{i}", 1), ("feedback", 0), (f"{i % 3}ok", 1)])

    args = short_args(tmp_path, probe_granularity="prefix", max_steps=3, max_completion_length=32)
    trainer = PrefixSpy(str(model_path), code_reward, args=args, train_dataset=prompts(), rollout_func=rollout)
    trainer.train()
    assert all(step["output"]["tool_mask"].eq(0).sum() == 4 * 8 for step in trainer.scored)  # "feedback" per row
    assert_token_advantages_reach_the_loss(trainer)
    for result in trainer.results:
        assert result.prefix.generated.gather(1, result.prefix.tokens).all()  # the probe never learns from feedback
    last, output = trainer.scored[-1], trainer.scored[-1]["output"]
    after = output["tool_mask"].bool() & output["tool_mask"].eq(0).cumsum(1).gt(0) & output["completion_mask"].bool()
    assert after.any() and (last["advantages"][after] != 0).all()  # the policy's tokens after the feedback


def test_importance_weights_multiply_the_token_advantages(model_path, tmp_path, monkeypatch):
    args = short_args(
        tmp_path, probe_granularity="prefix", max_steps=3, prompt_selection="importance", probe_warmup_steps=1
    )
    trainer = PrefixSpy(str(model_path), code_reward, args=args, train_dataset=prompts(16))
    calls, advantages = [], trainer.estimator.advantages

    def recorded(features, rollouts, **kwargs):
        result = advantages(features, rollouts, **kwargs)
        plain = advantages(features, replace(rollouts, weights=None), **kwargs).token_advantages
        calls.append((rollouts.weights, plain, result.token_advantages))
        return result

    monkeypatch.setattr(trainer.estimator, "advantages", recorded)
    trainer.train()
    weighted_steps = [(w, plain, weighted) for w, plain, weighted in calls if weighted is not None]
    assert weighted_steps and any(w.tolist() != [1.0] * len(w) for w, _, _ in weighted_steps)
    for weights, plain, weighted in weighted_steps:
        torch.testing.assert_close(weighted, plain * weights.to(plain.dtype)[:, None])
    assert torch.equal(trainer.scored[-1]["advantages"], calls[-1][2][:, : trainer.scored[-1]["advantages"].size(1)])


def _prefix_batch(seed: int, rows: int = 4, samples: int = 4, width: int = 21) -> PrefixBatch:
    g = torch.Generator().manual_seed(seed)
    return PrefixBatch(
        torch.randn(rows, samples, width, generator=g),
        torch.ones(rows, samples, dtype=torch.bool),
        None,
        torch.ones(rows, 6, dtype=torch.bool),
        torch.zeros(rows, samples, dtype=torch.long),
    )


def test_prefix_state_round_trips_and_warm_starts(tmp_path):
    estimator = POISEEstimator(2, PREFIX)
    for step in range(3):
        estimator.observe(features=torch.randn(4, 5), rollouts=Rollouts(torch.rand(4)), prefix=_prefix_batch(step))
    assert estimator.token_baseline_.trusted and len(estimator.token_baseline_.buffer) == 48
    estimator.save(tmp_path / "full.safetensors")
    estimator.save(tmp_path / "probe.safetensors", include_buffer=False)
    resumed = POISEEstimator(2, PREFIX)
    resumed.load(tmp_path / "full.safetensors")
    a, b = estimator.token_baseline_.state_dict(), resumed.token_baseline_.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    assert (resumed.token_baseline_.steps, resumed.token_baseline_.trusted) == (3, True)
    warm = POISEEstimator(2, PREFIX)
    warm.load(tmp_path / "probe.safetensors", warm_start=True)
    assert warm.token_baseline_.trusted and len(warm.token_baseline_.buffer) == 0
    loaded = warm.token_baseline_.map().prefix.clone()
    assert torch.equal(loaded, estimator.token_baseline_.map().prefix)
    new_rows = dict(features=torch.randn(4, 5), rollouts=Rollouts(torch.rand(4)))
    warm.observe(**new_rows, prefix=_prefix_batch(10))  # 1 step of new rows: fit kept
    assert torch.equal(warm.token_baseline_.map().prefix, loaded)
    warm.observe(**new_rows, prefix=_prefix_batch(11))  # warmup_steps of rows: refit
    assert not torch.equal(warm.token_baseline_.map().prefix, loaded)


@pytest.mark.parametrize("capture", ["auto", "pass"])
def test_a_vlm(vlm_path, tmp_path, capture):  # noqa: F811 (the fixture imported above)
    """A LLaVA-style model whose prompts hold image tokens: the prefix capture rides on the loss's forward with the
    images ("auto") or on POISE's own pass with them ("pass"), and the token advantages reach the loss."""
    args = vision_args(tmp_path, probe_granularity="prefix", max_steps=3, probe_warmup_steps=1, probe_capture=capture)
    trainer = PrefixSpy(str(vlm_path), code_reward, args=args, train_dataset=image_prompts())
    trainer.train()
    assert trainer.feature_passes == (0 if capture == "auto" else 3)
    assert_token_advantages_reach_the_loss(trainer)
