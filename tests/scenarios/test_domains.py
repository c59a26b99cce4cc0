"""Per-domain probes (`probe_domain_column`): one OnlineLearner (probe, buffer, bootstrap) per value of the column."""

import copy

import pytest
import torch
from datasets import Dataset

from poise_trl import POISEConfig, POISETrainer
from poise_trl.estimator.estimator import POISEEstimator, Rollouts
from poise_trl.estimator.files import read_state
from poise_trl.estimator.learner import OnlineLearner
from poise_trl.estimator.specs import BufferSpec, EstimatorSpec, HeadSpec
from poise_trl.grpo.trainer import ESTIMATOR_FILE, prompt_group_ids
from poise_trl.heads.probe import ValueProbe

from ..conftest import CPU_ARGS, digit_reward, poise_args
from ..tiny_archs import SpyTrainer


# ------------------------------------------------------------------------------------------------- pure level
def _two_domain_rollouts(n_prompts: int, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """Two domains with success rates ~0.8 and ~0.2 whose features share one distribution (the domain is not
    visible in them); within a domain a weak feature direction shifts the odds. G=2 rollouts per prompt."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, base in (("easy", 1.4), ("hard", -1.4)):
        x = torch.randn(n_prompts, 2, 12, generator=g)  # (prompt, rollout, feature)
        p = torch.sigmoid(base + 0.8 * x[..., 0])
        rewards = torch.bernoulli(p, generator=g)
        targets = rewards.flip(1)  # leave-one-out target for G=2: the partner's reward
        groups = torch.arange(n_prompts).repeat_interleave(2) + (0 if name == "easy" else 10**6)
        out[name] = {"x": x.reshape(-1, 1, 12), "y": targets.reshape(-1), "groups": groups}
    return out


def _mae(online: OnlineLearner, data: dict[str, torch.Tensor]) -> float:
    return (online.predict(data["x"]) - data["y"]).abs().mean().item()


def test_per_domain_probes_beat_one_shared_probe_on_held_out_rows():
    train, test = _two_domain_rollouts(400, seed=0), _two_domain_rollouts(400, seed=1)

    def online() -> OnlineLearner:
        return OnlineLearner(ValueProbe(alpha=1.0, clip=(0.0, 1.0)), capacity=4096)

    shared, per_domain = online(), {name: online() for name in train}
    for step in range(4):  # fed online, a quarter of every domain per step, as a run would
        rows = slice(step * 200, (step + 1) * 200)
        for name, data in train.items():
            batch = (data["x"][rows], data["y"][rows], data["groups"][rows])
            shared = shared.added(*batch)
            per_domain[name] = per_domain[name].added(*batch)
    shared = shared.fitted()
    per_domain = {name: probe.fitted() for name, probe in per_domain.items()}
    assert len(shared.buffer) == 1600 and all(len(p.buffer) == 800 for p in per_domain.values())

    shared_mae = sum(_mae(shared, data) for data in test.values()) / 2
    domain_mae = sum(_mae(per_domain[name], data) for name, data in test.items()) / 2
    # Measured: shared 0.50, per-domain 0.34. The shared probe predicts ~0.5 for both domains.
    assert domain_mae < shared_mae - 0.08, (shared_mae, domain_mae)


# --------------------------------------------------------------------------------------------- trainer level
# 2 of 32 prompts are in the "small" domain: too little data for its own probe. With seed 0, TRL's sampler draws
# prompt 6 at step 3 (when "big" is already trusted) and prompt 17 after step 4.
SMALL_PROMPTS = {6, 17}


def _dataset() -> Dataset:
    rows = []
    for i in range(32):
        rows.append({"prompt": f"{i % 10}{(3 * i) % 10}+{i % 7}", "domain": "small" if i in SMALL_PROMPTS else "big"})
    return Dataset.from_list(rows)


def _args(tmp_path, **kwargs) -> POISEConfig:
    domains = dict(probe_domain_column="domain", probe_domain_buffer_sizes='{"big": 20}')  # JSON, as from a CLI/YAML
    return poise_args(tmp_path, **{"probe_warmup_steps": 2, **domains, **kwargs})


class DomainRecorder(SpyTrainer):
    """Per step: each domain's probe and trust as they were before the step and the rows' domains; `SpyTrainer`
    adds the rewards, features and advantages."""

    def before_batch(self, inputs):
        before = {name: (copy.deepcopy(p.probe), p.trusted) for name, p in self.estimator.probes_.items()}
        return dict(before=before, domains=[x["domain"] for x in inputs])

    @property
    def records(self) -> list[dict]:
        return self.scored


def test_domains_get_separate_buffers_metrics_bootstrap_and_checkpoints(tiny_model_path, tmp_path):
    args = _args(tmp_path, save_strategy="steps", save_steps=3)
    trainer = DomainRecorder(str(tiny_model_path), digit_reward, args=args, train_dataset=_dataset())
    trainer.train()

    # Separate buffers: each domain's rows came only from its prompts; "big" is capped at its own size.
    prompts = {d: [r["prompt"] for r in _dataset() if r["domain"] == d] for d in ("big", "small")}
    probes = trainer.estimator.probes_
    assert set(probes) == {"big", "small"}
    for name, online in probes.items():
        assert set(online.buffer.groups.tolist()) <= set(prompt_group_ids(prompts[name]).tolist())
        assert online.buffer.features.shape[1:] == (1, 2 * 128 + 3)
    assert probes["big"].buffer.capacity == 20 == len(probes["big"].buffer)
    assert probes["small"].buffer.capacity == args.probe_buffer_size
    assert probes["big"].steps == 4 and 1 <= probes["small"].steps < args.probe_warmup_steps

    # Per row: a trusted domain's rows get the cross-rollout probe baseline, an untrusted one's the partner's reward.
    mixed = 0
    for record in trainer.records:
        rewards, advantages = record["rewards"], record["advantages"]
        domains = record["domains"]
        for name in set(domains):
            rows = torch.tensor([d == name for d in domains])
            probe, trusted = record["before"].get(name, (None, False))
            if trusted:
                values = probe.predict(record["features"][rows][:, 0])
                expected = rewards[rows] - values.view(-1, 2).flip(1).reshape(-1)
            else:
                expected = rewards[rows] - rewards[rows].view(-1, 2).flip(1).reshape(-1)
            torch.testing.assert_close(advantages[rows], expected, atol=2e-4, rtol=1e-4)
        mixed += "small" in domains and record["before"]["big"][1]
    assert mixed >= 1  # a step where "big" used its probe and "small", in the same batch, fell back to RLOO

    # Metrics overall and per domain.
    logged = [h for h in trainer.state.log_history if "poise/mae" in h]
    assert len(logged) == 4
    for key in ("mae", "pearson_r", "variance_reduction", "buffer_size", "bootstrap"):
        assert any(f"poise/domain/big/{key}" in h for h in logged), key
    assert any("poise/domain/small/bootstrap" in h for h in logged)
    assert all(h["poise/domain/small/bootstrap"] == 1.0 for h in logged if "poise/domain/small/bootstrap" in h)
    assert [h["poise/domain/big/bootstrap"] for h in logged] == [1.0, 1.0, 0.0, 0.0]
    assert logged[-1]["poise/buffer_size"] == 20 + len(trainer.estimator.probes_["small"].buffer)

    # The checkpoint holds every domain; resuming reproduces step 4 bit for bit.
    checkpoint = tmp_path / "out" / "checkpoint-3"
    info = read_state(checkpoint / ESTIMATOR_FILE)["info"]
    assert [d["name"] for d in info["domains"]] == list(trainer.estimator.probes_)
    assert info["feature_config"]["probe_domain_column"] == "domain"
    resumed = DomainRecorder(str(tiny_model_path), digit_reward, args=args, train_dataset=_dataset())
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert len(resumed.records) == 1
    assert torch.equal(resumed.records[0]["advantages"], trainer.records[3]["advantages"])
    assert list(resumed.estimator.probes_) == list(trainer.estimator.probes_)
    for name, online in trainer.estimator.probes_.items():
        again = resumed.estimator.probes_[name]
        assert (again.steps, again.layer_index, again.warm_started) == (
            online.steps,
            online.layer_index,
            online.warm_started,
        )
        assert torch.equal(again.buffer.features, online.buffer.features)
        assert torch.equal(again.buffer.groups, online.buffer.groups)
        for key, tensor in online.probe.state_dict().items():
            assert torch.equal(again.probe.state_dict()[key], tensor), (name, key)

    # save_probe / warm start carry every domain; a run without the domain column refuses the file.
    trainer.save_probe(tmp_path / "all.safetensors")
    assert [d["name"] for d in read_state(tmp_path / "all.safetensors")["info"]["domains"]] == ["big", "small"]
    warm = POISETrainer(
        str(tiny_model_path),
        digit_reward,
        args=_args(tmp_path, probe_init_path=str(tmp_path / "all.safetensors")),
        train_dataset=_dataset(),
    )
    assert all(p.warm_started and p.steps == 0 for p in warm.estimator.probes_.values())
    assert warm.estimator.probes_["big"].trusted  # fitted: used from the first step
    with pytest.raises(ValueError, match="probe_domain_column=None"):
        POISETrainer(
            str(tiny_model_path),
            digit_reward,
            args=_args(
                tmp_path,
                probe_domain_column=None,
                probe_domain_buffer_sizes=None,
                probe_init_path=str(tmp_path / "all.safetensors"),
            ),
            train_dataset=_dataset(),
        )


def test_missing_domain_column_fails_with_the_columns_present(tiny_model_path, tmp_path):
    """At construction when the dataset lacks it; at the first batch when TRL drops it (remove_unused_columns)."""
    with pytest.raises(ValueError, match=r"probe_domain_column='topic', but train_dataset has the columns .*'domain'"):
        POISETrainer(
            str(tiny_model_path),
            digit_reward,
            args=_args(tmp_path, max_steps=1, probe_domain_column="topic", probe_domain_buffer_sizes=None),
            train_dataset=_dataset(),
        )
    trainer = POISETrainer(
        str(tiny_model_path),
        digit_reward,
        args=_args(tmp_path, max_steps=1, remove_unused_columns=True),
        train_dataset=_dataset(),
    )
    with pytest.raises(ValueError, match=r"probe_domain_column='domain', but the batch has no such column"):
        trainer.train()


def test_more_domain_values_than_probe_max_domains_fail_at_start_up(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match=r"'domain' has 2 distinct values, more than probe_max_domains=1"):
        POISETrainer(
            str(tiny_model_path), digit_reward, args=_args(tmp_path, probe_max_domains=1), train_dataset=_dataset()
        )


def test_the_estimator_refuses_a_domain_past_max_domains_and_buffers_grow_with_their_rows():
    buffers = BufferSpec(size=4096, max_domains=2, warmup_steps=0)
    estimator = POISEEstimator(2, EstimatorSpec(head=HeadSpec(alpha=1.0), buffer=buffers))
    x, r = torch.randn(8, 1, 16), torch.tensor([0.0, 1.0] * 4)
    estimator.observe(features=x, rollouts=Rollouts(r, domains=["a"] * 6 + ["b"] * 2))
    assert {name: online.buffer.allocated for name, online in estimator.probes_.items()} == {"a": 8, "b": 8}
    with pytest.raises(ValueError, match=r"3 distinct domains \('a', 'b', 'c'\) exceed max_domains=2"):
        estimator.advantages(x, Rollouts(r, domains=["c"] * 8))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(probe_domain_buffer_sizes={"a": 64}), "needs probe_domain_column"),
        (dict(probe_domain_column="d", probe_domain_buffer_sizes={"a": 3}), "at least two groups"),
        (dict(probe_domain_column="d", probe_domain_buffer_sizes="[64]"), "JSON object"),
        (dict(probe_domain_column=""), "use None"),
    ],
)
def test_domain_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        POISEConfig(output_dir="unused", per_device_train_batch_size=4, **{**CPU_ARGS, **kwargs})


def test_domain_buffer_sizes_parse_from_json():
    c = POISEConfig(
        output_dir="unused",
        per_device_train_batch_size=4,
        probe_domain_column="d",
        probe_domain_buffer_sizes='{"math": 4096, "code": 512}',
        **CPU_ARGS,
    )
    assert c.probe_domain_buffer_sizes == {"math": 4096, "code": 512}
