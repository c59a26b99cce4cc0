"""`POISEEstimator` with plain tensors: its contract, its file (bit-for-bit round trip, atomic write, no pickle),
the files of poise-trl 0.1 (tests/fixtures/legacy), and one device->host transfer per step."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from poise_trl import POISEConfig, files, sampling
from poise_trl.config import ESTIMATOR_FIELDS
from poise_trl.estimator import POISEEstimator
from poise_trl.files import read_state

from .conftest import CPU_ARGS
from .host_sync import HostSyncCounter

LEGACY = Path(__file__).parent / "fixtures" / "legacy"
G = 2


def _batch(step: int, n: int = 16, width: int = 6, domains: bool = False, rewards: tuple = (0.0, 1.0)):
    """Features whose first column predicts the reward, binary rewards, prompt ids and (optionally) two domains."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, width, generator=g)
    low, high = rewards
    r = torch.where(torch.rand(n, generator=g) < torch.sigmoid(2 * x[:, 0]), high, low)
    groups = torch.arange(n) // G + 100 * step
    names = [["math", "code"][(i // G) % 2] for i in range(n)] if domains else None
    return x, r, groups, names


def _trained(steps: int = 4, **settings) -> POISEEstimator:
    estimator = POISEEstimator(G, alpha=1.0, warmup_steps=1, **settings)
    for step in range(steps):
        x, r, groups, names = _batch(step, domains="domain" in settings.get("feature_config", {}))
        estimator.advantages(x, r, domains=names)
        estimator.observe(x, r, groups, domains=names)
    return estimator


def test_advantages_use_only_earlier_observations():
    estimator = _trained()
    x, r, _, _ = _batch(10)
    first = estimator.advantages(x, r)
    again = estimator.advantages(x, r)
    assert torch.equal(first.advantages, again.advantages)  # advantages learn nothing
    assert first.metrics()["bootstrap"] == 0.0 and torch.isfinite(first.baselines).all()
    estimator.observe(x, r)
    assert not torch.equal(estimator.advantages(x, r).advantages, first.advantages)  # observe does


def test_predict_and_advantages_change_nothing_and_observe_reuses_the_handed_batch():
    estimator = _trained()
    before = estimator.state_dict()
    x, r, groups, _ = _batch(11)
    values = estimator.predict(x, r)
    result = estimator.advantages(x, r)
    assert torch.equal(values, result.values) and values.isfinite().all()
    after = estimator.state_dict()
    assert before["info"] == after["info"]
    assert all(torch.equal(tensor, after["tensors"][key]) for key, tensor in before["tensors"].items())
    handed, fresh = _trained(), _trained()
    handed.observe(group_ids=groups, result=handed.advantages(x, r))
    fresh.observe(x, r, groups)  # the same learning, the batch prepared again
    assert torch.equal(
        handed.probes["default"].probe.state_dict()["coef"], fresh.probes["default"].probe.state_dict()["coef"]
    )
    with pytest.raises(ValueError, match="holds a batch of 16 rows"):
        handed.observe(x[:8], r[:8], result=result)


def test_state_round_trips_bit_for_bit_through_one_atomic_file(tmp_path):
    settings = dict(scale_rewards="batch", domain_buffer_sizes={"code": 8}, feature_config={"domain": True})
    estimator = _trained(6, **settings)
    path = tmp_path / "poise.safetensors"
    estimator.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["poise.safetensors"]  # one file, no temporary left
    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["poise"])["format"] == "poise-estimator/1"

    loaded = POISEEstimator(G, alpha=1.0, warmup_steps=1, **settings)
    loaded.load(path)
    saved, restored = estimator.state_dict(), loaded.state_dict()
    assert saved["info"] == restored["info"]
    assert saved["tensors"].keys() == restored["tensors"].keys()
    for key, tensor in saved["tensors"].items():
        assert torch.equal(tensor, restored["tensors"][key]), key
    assert len(loaded.probes["code"].buffer) == 8
    for step in range(6, 9):  # the two continue identically
        x, r, groups, names = _batch(step, domains=True)
        a, b = estimator.advantages(x, r, domains=names), loaded.advantages(x, r, domains=names)
        assert torch.equal(a.advantages, b.advantages) and a.metrics() == pytest.approx(b.metrics(), nan_ok=True)
        estimator.observe(x, r, groups, domains=names)
        loaded.observe(x, r, groups, domains=names)
    for name, online in estimator.probes.items():
        for key, tensor in online.probe.state_dict().items():
            assert torch.equal(loaded.probes[name].probe.state_dict()[key], tensor), (name, key)


def test_the_random_selection_stream_resumes_where_the_checkpoint_left_it(tmp_path):
    """Random draws are seeded by (seed, rank, observed steps), and the step count travels in the estimator's file."""

    def choice(estimator: POISEEstimator) -> list[int]:
        drawn = sampling.draw("value", 10, 4, seed=7, rank=0, step=estimator.steps).indices
        estimator.observe(*_batch(estimator.steps)[:3])
        return drawn

    estimator = POISEEstimator(G, warmup_steps=100)
    uninterrupted = [choice(estimator) for _ in range(5)]
    first = POISEEstimator(G, warmup_steps=100)
    [choice(first) for _ in range(2)]
    first.save(tmp_path / "e.safetensors")
    resumed = POISEEstimator(G, warmup_steps=100)
    resumed.load(tmp_path / "e.safetensors")
    assert [choice(resumed) for _ in range(3)] == uninterrupted[2:]
    assert len({tuple(c) for c in uninterrupted}) > 1


def test_a_resumed_estimator_draws_the_importance_samplers_prompts_and_weights_exactly(tmp_path):
    """Once the probe is trusted the importance rule draws from the estimator's prompt values; a resumed estimator
    predicts the same values bit for bit and sits at the same step, so it draws the same prompts and weights."""
    candidates = torch.randn(10, 6, generator=torch.Generator().manual_seed(1))

    def choice(estimator: POISEEstimator) -> sampling.Draw:
        values = estimator.prompt_values(candidates)
        reward_range = None if values is None else estimator.target_range()
        drawn = sampling.draw("importance", 10, 4, values, reward_range, seed=7, rank=0, step=estimator.steps)
        estimator.observe(*_batch(estimator.steps)[:3])
        return drawn

    def estimator() -> POISEEstimator:
        return POISEEstimator(G, alpha=1.0, warmup_steps=2, prompt_columns=(0, 6))

    full = estimator()
    uninterrupted = [choice(full) for _ in range(6)]
    assert uninterrupted[0].weights is None and all(d.weights for d in uninterrupted[3:])  # uniform, then weighted
    first = estimator()
    [choice(first) for _ in range(3)]
    first.save(tmp_path / "e.safetensors")
    resumed = estimator()
    resumed.load(tmp_path / "e.safetensors")
    assert [choice(resumed) for _ in range(3)] == uninterrupted[3:]


def test_an_interrupted_write_keeps_the_previous_file(tmp_path, monkeypatch):
    estimator = _trained(2)
    path = tmp_path / "poise.safetensors"
    estimator.save(path)
    before = path.read_bytes()

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(files, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        _trained(3).save(path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["poise.safetensors"]


def test_resume_refuses_another_bootstrap_and_warm_start_accepts_it(tmp_path):
    _trained(2, bootstrap="shrunk").save(tmp_path / "e.safetensors")
    with pytest.raises(ValueError, match="probe_bootstrap='shrunk'.*this run sets probe_bootstrap='rloo'"):
        POISEEstimator(G, alpha=1.0, bootstrap="rloo").load(tmp_path / "e.safetensors")
    warm = POISEEstimator(G, alpha=1.0, bootstrap="rloo")
    warm.load(tmp_path / "e.safetensors", warm_start=True)
    assert warm.trusted and warm.steps == 0


def test_bootstrap_counts_the_rows_that_really_got_the_fallback():
    """A trusted probe, but one row without usable features: its partner's baseline falls back, its own does not."""
    estimator = _trained(3)
    x, r, _, _ = _batch(20)
    x[5] = float("nan")
    result = estimator.advantages(x, r)
    metrics = result.metrics()
    assert metrics["bootstrap"] == pytest.approx(1 / 16)
    assert metrics["feature_rows_dropped"] == 1.0 and metrics["unscorable_rows"] == 0.0
    intercept, weight = estimator.bootstrap_lines["default"]  # row 4's only partner, row 5, has no usable features
    torch.testing.assert_close(result.baselines[4].double(), intercept + weight * r[5].double())
    values = estimator.probes["default"].predict(torch.cat([x, r[:, None]], 1)[:, None])
    assert result.baselines[5] == values[4]  # row 5's own baseline still comes from its partner's probe value


def test_unscorable_rows_are_counted_apart_from_dropped_features():
    estimator = _trained(2)
    x, r, _, _ = _batch(30)
    r[:3] = float("nan")
    metrics = estimator.advantages(x, r).metrics()
    assert metrics["unscorable_rows"] == 3.0 and metrics["feature_rows_dropped"] == 0.0


@pytest.mark.parametrize(("low", "high"), [(0.0, 1.0), (-1.0, 1.0), (0.5, 1.5)])
def test_selection_scores_the_reward_variance_on_the_observed_reward_range(low, high):
    """q(1 - q) with q the predicted value mapped from the observed [low, high] to [0, 1]: with ±1 rewards a
    prompt predicted at 0 (50% success) scores highest, not one at 0.5 (75% success) as p(1 - p) would say."""
    estimator = POISEEstimator(G, alpha=1.0, warmup_steps=1, prompt_columns=(0, 6))
    for step in range(3):
        x, r, groups, _ = _batch(step, rewards=(low, high))
        estimator.observe(x, r, groups)
    values = torch.tensor([low, low + 0.5 * (high - low), low + 0.75 * (high - low), high])
    scores = sampling.reward_variance(values, *estimator.target_range())
    torch.testing.assert_close(scores, torch.tensor([0.0, 0.25, 0.1875, 0.0], dtype=torch.float64))


def test_selection_waits_for_a_trusted_probe_and_a_warm_start_is_trusted(tmp_path):
    cold = POISEEstimator(G, alpha=1.0, warmup_steps=5, prompt_columns=(0, 6))
    x, r, groups, _ = _batch(0)
    cold.observe(x, r, groups)
    assert not cold.trusted and cold.prompt_values(torch.zeros(3, 6)) is None
    _trained(3, prompt_columns=(0, 6)).save(tmp_path / "e.safetensors")
    warm = POISEEstimator(G, alpha=1.0, warmup_steps=5, prompt_columns=(0, 6))
    warm.load(tmp_path / "e.safetensors", warm_start=True)
    assert warm.trusted and warm.prompt_values(torch.zeros(3, 6)).shape == (3,)


def test_one_host_transfer_per_step():
    """`advantages`, `observe` and reading the metrics and logged rows cost one device->host transfer together."""
    estimator = POISEEstimator(G, alpha=1.0, warmup_steps=1, scale_rewards="batch")
    counter = HostSyncCounter()
    for step in range(5):
        x, r, groups, _ = _batch(step)
        r[0] = float("nan")
        x[3] = float("inf")
        counter.count, counter.calls = 0, []
        with counter:
            result = estimator.advantages(x, r)
            estimator.observe(group_ids=groups, result=result)
            result.metrics()
            result.logged_rows()
        assert counter.count == 1, (step, counter.calls)


# ------------------------------------------------------------------------------------------------ poise-trl 0.1
def _legacy_estimator() -> POISEEstimator:
    """Configured as tests/fixtures/legacy/make_legacy.py's run (its probe file's settings)."""
    info = json.loads((LEGACY / "probe.safetensors.json").read_text())
    return POISEEstimator(
        G,
        alpha=100.0,
        pca_dims=[(0, 16, 16), (16, 32, 16)],
        warmup_steps=1,
        layers=[1],
        feature_config={**info["feature_config"], "probe_domain_column": None},
    )


def test_a_0_1_checkpoint_resumes_exactly():
    expected = load_file(str(LEGACY / "expected.safetensors"))
    estimator = _legacy_estimator()
    checkpoint = LEGACY / "checkpoint"
    estimator.load(checkpoint / "poise_probe.safetensors", bootstrap_path=checkpoint / "poise_bootstrap.safetensors")
    online = estimator.probes["default"]
    assert torch.equal(online.predict(expected["inputs"]), expected["predictions"])
    assert (estimator.steps, online.steps, len(online.buffer), len(estimator.bootstrap_pairs["default"])) == (
        3,
        3,
        12,
        12,
    )
    torch.testing.assert_close(estimator.bootstrap_lines["default"], expected["bootstrap_line"], rtol=1e-12, atol=0)
    assert estimator.reward_std.state.tolist() == expected["reward_std"].tolist()


def test_a_0_1_probe_file_warm_starts():
    expected = load_file(str(LEGACY / "expected.safetensors"))
    estimator = _legacy_estimator()
    estimator.load(LEGACY / "probe.safetensors", warm_start=True)
    online = estimator.probes["default"]
    assert online.warm_started and online.trusted and estimator.steps == 0 and len(online.buffer) == 12
    assert torch.equal(online.predict(expected["inputs"]), expected["predictions"])
    state = read_state(LEGACY / "probe.safetensors")
    assert state["info"]["feature_config"]["probe_domain_column"] is None


def test_the_trainer_resumes_a_0_1_checkpoint_and_warns_without_one(tmp_path):
    from poise_trl import POISETrainer
    from poise_trl.models.tiny import save_tiny

    from .conftest import digit_dataset, digit_reward, short_args

    model = save_tiny(tmp_path / "model", num_layers=2, hidden_size=16, seed=0)
    trainer = POISETrainer(str(model), digit_reward, args=short_args(tmp_path), train_dataset=digit_dataset())
    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(LEGACY / "checkpoint", checkpoint)
    trainer._load_optimizer_and_scheduler(str(checkpoint))
    expected = load_file(str(LEGACY / "expected.safetensors"))
    assert torch.equal(trainer.probes["default"].predict(expected["inputs"]), expected["predictions"])
    assert trainer.probe_steps == 3 and len(trainer.bootstrap_pairs["default"]) == 12

    empty = tmp_path / "checkpoint-9"
    empty.mkdir()
    with pytest.warns(UserWarning, match="checkpoint-9.*holds no POISE state"):
        trainer._load_optimizer_and_scheduler(str(empty))


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("num_generations", 1),
        ("warmup_steps", -3),
        ("layer_folds", 1),
        ("clip", [1.0, 0.0]),
        ("buffer_size", 0),
        ("domain_buffer_sizes", {"math": 3}),
        ("layer_switch_margin", -0.1),
        ("layer_select_every", 0),
        ("alpha", 0.0),
        ("bootstrap", "mean"),
        ("scale_rewards", "group"),
    ],
)
def test_the_estimator_refuses_what_the_config_refuses_in_the_same_words(argument, value):
    field = ESTIMATOR_FIELDS[argument]
    with pytest.raises(ValueError) as refused_by_estimator:
        POISEEstimator(**{"num_generations": G, argument: value})
    extra = {"probe_domain_column": "domain"} if argument == "domain_buffer_sizes" else {}
    with pytest.raises(ValueError) as refused_by_config:
        POISEConfig(output_dir="unused", per_device_train_batch_size=4, **{**CPU_ARGS, field: value, **extra})
    assert str(refused_by_config.value) == str(refused_by_estimator.value).replace(argument, field, 1)


def test_a_layer_index_past_the_hooked_layers_is_refused():
    with pytest.raises(ValueError, match=r"layer_index=2 is not a slice of the 2 hooked layers \[8, 12\]"):
        POISEEstimator(G, layers=(8, 12), layer_index=2)


def test_the_partner_reward_column_stays_outside_an_integer_pca():
    """pca_dims=4 is the PCA of the 6 feature columns; the reward (column 7) passes through it untouched."""
    estimator = _trained(steps=2, pca_dims=4)
    probe = estimator.probes["default"].probe
    assert probe._pca_blocks == [(0, 6)] and probe.fitted_pca_dims == [4]
    with pytest.raises(ValueError, match=r"covers column 6, the partner-reward column"):
        _trained(steps=1, pca_dims=[(0, 7, 4)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_reward_column_keeps_fp32_whatever_the_features_dtype(dtype):
    x, r, groups, _ = _batch(0)
    r = torch.where(r > 0, 70_000.3, 0.3)  # 0.3 reads 0.30078125 in bf16; 70,000 overflows fp16
    estimator = POISEEstimator(G, alpha=1.0, warmup_steps=1)
    result = estimator.advantages(x.to(dtype), r)
    estimator.observe(x.to(dtype), r, groups)
    buffered = estimator.probes["default"].buffer.features[:, 0, -1]
    assert buffered.dtype == torch.float32 and set(buffered.tolist()) == set(r.float().tolist())
    assert result.metrics()["feature_rows_dropped"] == 0.0


def test_rows_whose_reward_overflows_the_column_are_dropped_and_counted():
    x, r, groups, _ = _batch(0)
    r = r.double()
    r[0] = 1e39  # finite in float64, inf in the fp32 column
    estimator = POISEEstimator(G, alpha=1.0, warmup_steps=1)
    metrics = estimator.advantages(x, r).metrics()
    estimator.observe(x, r, groups)
    assert metrics["feature_rows_dropped"] == 1.0
    assert torch.isfinite(estimator.probes["default"].buffer.features).all()
