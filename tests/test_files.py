"""The estimator's file (files.py): one atomic safetensors file that round-trips bit for bit, refuses another
bootstrap on resume, keeps the previous file when a write fails, and reads poise-trl 0.1's files
(tests/fixtures/legacy)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from poise_trl.estimator import files
from poise_trl.estimator.baselines import shrunk_rloo_line
from poise_trl.estimator.buffer import ProbeBuffer
from poise_trl.estimator.estimator import POISEEstimator, Rollouts
from poise_trl.estimator.files import load_probe_file, read_state, save_probe_file
from poise_trl.estimator.specs import PromptSpec
from poise_trl.features.columns import DEFAULT_SCALARS
from poise_trl.heads.heads import HEADS
from poise_trl.heads.probe import ValueProbe

from .test_estimator import LEGACY, G, _batch, _legacy_estimator, _trained, spec
from .test_probe import _data


def test_state_round_trips_bit_for_bit_through_one_atomic_file(tmp_path):
    settings = spec(scale_rewards="batch", buffer={"domain_sizes": {"code": 8}})
    estimator = _trained(6, settings, domains=True)
    path = tmp_path / "poise.safetensors"
    estimator.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["poise.safetensors"]  # one file, no temporary left
    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["poise"])["format"] == "poise-estimator/1"

    loaded = POISEEstimator(G, settings)
    loaded.load(path)
    saved, restored = estimator.state_dict(), loaded.state_dict()
    assert saved["info"] == restored["info"]
    assert saved["tensors"].keys() == restored["tensors"].keys()
    for key, tensor in saved["tensors"].items():
        assert torch.equal(tensor, restored["tensors"][key]), key
    assert len(loaded.probes_["code"].buffer) == 8
    for step in range(6, 9):  # the two continue identically
        x, r, groups, names = _batch(step, domains=True)
        a, b = estimator.advantages(x, Rollouts(r, domains=names)), loaded.advantages(x, Rollouts(r, domains=names))
        assert torch.equal(a.advantages, b.advantages) and a.metrics() == pytest.approx(b.metrics(), nan_ok=True)
        for learner in (estimator, loaded):
            learner.observe(features=x, rollouts=Rollouts(r, domains=names, prompt_ids=groups))
    for name, online in estimator.probes_.items():
        for key, tensor in online.probe.state_dict().items():
            assert torch.equal(loaded.probes_[name].probe.state_dict()[key], tensor), (name, key)


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
    _trained(2, spec(bootstrap="shrunk")).save(tmp_path / "e.safetensors")
    with pytest.raises(ValueError, match="probe_bootstrap='shrunk'.*this run sets probe_bootstrap='rloo'"):
        POISEEstimator(G, spec(bootstrap="rloo")).load(tmp_path / "e.safetensors")
    warm = POISEEstimator(G, spec(bootstrap="rloo"))
    warm.load(tmp_path / "e.safetensors", warm_start=True)
    assert warm.trusted_ and warm.steps_ == 0


def test_a_0_1_checkpoint_resumes_exactly():
    expected = load_file(str(LEGACY / "expected.safetensors"))
    estimator = _legacy_estimator()
    checkpoint = LEGACY / "checkpoint"
    estimator.load(checkpoint / "poise_probe.safetensors", bootstrap_path=checkpoint / "poise_bootstrap.safetensors")
    online = estimator.probes_["default"]
    assert torch.equal(online.predict(expected["inputs"]), expected["predictions"])
    assert (estimator.steps_, online.steps, len(online.buffer), len(estimator.bootstrap_pairs_["default"])) == (
        3,
        3,
        12,
        12,
    )
    # The pairs come back bit for bit, and the line is refit on them by today's rule: 0.1 saved its unclamped fit
    # (`expected["bootstrap_line"]`, w = -0.316), which issue 58 replaced by a weight held in [0, 1]
    pairs = load_file(str(checkpoint / "poise_bootstrap.safetensors"))
    restored = estimator.bootstrap_pairs_["default"]
    assert torch.equal(restored.features, pairs["0.features"]) and torch.equal(restored.targets, pairs["0.targets"])
    line = shrunk_rloo_line(pairs["0.features"][:, 0], pairs["0.targets"])
    assert torch.equal(estimator.bootstrap_lines_["default"], line) and 0 <= line[1] <= 1
    assert estimator.reward_std_.state.tolist() == expected["reward_std"].tolist()


def test_a_0_1_probe_file_warm_starts():
    expected = load_file(str(LEGACY / "expected.safetensors"))
    estimator = _legacy_estimator()
    estimator.load(LEGACY / "probe.safetensors", warm_start=True)
    online = estimator.probes_["default"]
    assert online.warm_started and online.trusted and estimator.steps_ == 0 and len(online.buffer) == 12
    assert torch.equal(online.predict(expected["inputs"]), expected["predictions"])
    state = read_state(LEGACY / "probe.safetensors")
    assert state["info"]["feature_config"]["probe_domain_column"] is None


def test_state_file_round_trip_predicts_identically(tmp_path):
    x, y = _data(64, 20)
    probe = ValueProbe(alpha=0.5, pca_dims=[(0, 10, 4)], clip=(0.0, 1.0)).fit(x, y)
    buffer = ProbeBuffer(100)
    buffer.add(x, y)
    save_probe_file(tmp_path / "p.safetensors", probe, buffer, {"probe_steps": 3})
    loaded, loaded_buffer, info = load_probe_file(tmp_path / "p.safetensors")
    assert torch.equal(loaded.predict(x), probe.predict(x))
    assert torch.equal(loaded_buffer.features, buffer.features) and info["probe_steps"] == 3
    assert (tmp_path / "p.safetensors.json").exists()


@pytest.mark.parametrize("head", sorted(HEADS))
def test_every_head_resumes_exactly_from_the_file(tmp_path, head):
    """The sequence value and the sampler's prompt values continue bit for bit after a save and load."""
    settings = spec(head={"name": head}, prompt=PromptSpec((0, 4)))
    estimator = _trained(3, settings)
    estimator.save(tmp_path / "e.safetensors")
    loaded = POISEEstimator(G, settings)
    loaded.load(tmp_path / "e.safetensors")
    assert loaded.state_dict()["info"]["domains"][0]["head"] == head
    assert type(loaded.probes_["default"].probe) is HEADS[head]
    for step in range(3, 5):
        x, r, groups, _ = _batch(step)
        a, b = estimator.advantages(x, Rollouts(r)), loaded.advantages(x, Rollouts(r))
        assert torch.equal(a.advantages, b.advantages)
        assert torch.equal(estimator.prompt_values(x[:, :4]), loaded.prompt_values(x[:, :4]))
        for learner in (estimator, loaded):
            learner.observe(features=x, rollouts=Rollouts(r, prompt_ids=groups))


def test_a_file_without_head_names_holds_ridge_and_another_head_is_refused(tmp_path):
    state = _trained(2).state_dict()
    for domain in state["info"]["domains"]:
        del domain["head"]  # as written before heads had names
    old = POISEEstimator(G, spec())
    old.load_state_dict(state)
    assert type(old.probes_["default"].probe) is ValueProbe and old.probes_["default"].trusted
    with pytest.raises(ValueError, match="refits with head 'ridge' .*, but this run sets head 'logistic'"):
        POISEEstimator(G, spec(head={"name": "logistic"})).load_state_dict(state)
    with pytest.raises(ValueError, match="is a 'ridge' head, but this run's head is 'mlp'"):
        POISEEstimator(G, spec(head={"name": "mlp"})).load_state_dict(state, warm_start=True)


def test_a_file_records_its_rows_scalars_and_refuses_other_ones(tmp_path):
    """Files written before `probe_scalars` hold the paper's three where their blocks hold "entropy" (none without);
    a file whose rows hold other scalars than this run's is refused, naming the setting."""
    features = {"probe_features": ["prompt", "reasoning", "entropy"], "probe_layer": 1}
    estimator = _trained(2)
    estimator.feature_config = features  # as a file written before probe_scalars has it
    estimator.save(tmp_path / "old.safetensors")
    paper = {**features, "probe_scalars": list(DEFAULT_SCALARS)}
    POISEEstimator(G, spec(), feature_config=paper).load(tmp_path / "old.safetensors")
    without = {"probe_features": ["prompt", "reasoning"], "probe_layer": 1}
    assert files.with_scalars(without) == {**without, "probe_scalars": []} and files.with_scalars(paper) == paper
    lengths = {**features, "probe_scalars": ["output_length", "output_repetition_ratio"]}
    with pytest.raises(ValueError, match=r"sets probe_scalars=\['output_length', 'output_repetition_ratio'\]"):
        POISEEstimator(G, spec(), feature_config=lengths).load(tmp_path / "old.safetensors")
