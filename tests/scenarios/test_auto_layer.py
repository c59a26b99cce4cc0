"""probe_layer="auto": every candidate layer hooked in the one pass, the layer chosen by prompt-grouped K-fold error
on earlier steps only, with hysteresis."""

import copy
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, HfArgumentParser

from poise_trl import POISEConfig, POISETrainer
from poise_trl.estimator.layer_choice import choose_layer, grouped_kfold_errors, select_layer
from poise_trl.estimator.learner import OnlineLearner
from poise_trl.features import features
from poise_trl.heads.probe import ValueProbe

from ..conftest import CPU_ARGS, digit_dataset, digit_reward, poise_args
from ..test_trainer import _count_scoring_passes
from ..tiny_archs import SpyTrainer


# ---------------------------------------------------------------------------------------------------- config
def _config(**kwargs) -> POISEConfig:
    return POISEConfig(output_dir="unused", per_device_train_batch_size=4, **{**CPU_ARGS, **kwargs})


def test_probe_layer_accepts_ints_auto_and_numeric_strings():
    assert _config().probe_layer is None
    assert _config(probe_layer="auto").probe_layer == "auto"
    assert _config(probe_layer="19").probe_layer == 19 and _config(probe_layer=-1).probe_layer == -1
    parser = HfArgumentParser(POISEConfig)
    cli = ["--output_dir", "x", "--use_cpu", "true", "--bf16", "false", "--per_device_train_batch_size", "4"]
    (args,) = parser.parse_args_into_dataclasses([*cli, "--probe_layer", "-1"])
    assert args.probe_layer == -1
    (args,) = parser.parse_args_into_dataclasses([*cli, "--probe_layer", "auto", "--probe_layer_candidates", "1", "3"])
    assert (args.probe_layer, args.probe_layer_candidates) == ("auto", [1, 3])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(probe_layer="middle"), "'auto', or None"),
        (dict(probe_layer=2, probe_layer_candidates=[1, 2]), "only used with probe_layer='auto'"),
        (dict(probe_layer="auto", probe_layer_candidates=[]), "non-empty list"),
        (dict(probe_layer="auto", probe_layer_select_every=0), ">= 1"),
        (dict(probe_layer="auto", probe_layer_switch_margin=1.0), r"\[0, 1\)"),
        (dict(probe_layer="auto", probe_layer_folds=1), ">= 2"),
    ],
)
def test_bad_layer_settings_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _config(**kwargs)


# --------------------------------------------------------------------------------------------- trainer level
def _args(tmp_path, **kwargs) -> POISEConfig:
    auto = dict(probe_layer="auto", probe_layer_select_every=2, probe_layer_folds=2, probe_layer_switch_margin=0.0)
    return poise_args(tmp_path, **{"max_steps": 5, **auto, **kwargs})


class LayerRecorder(SpyTrainer):
    """Per step: the layer in use, the buffer and probe as they were before the step, the step's (N, C, D)
    features, rewards and advantages."""

    def before_batch(self, inputs):
        # before the first step nothing is learned: the unfitted learner a new domain starts from
        online = self.estimator.probes_.get("default") or self.estimator.new_probe("default")
        buffer = online.buffer
        return dict(
            index=self.estimator.layer_index_,
            layer=self.estimator.layer_,
            probe=copy.deepcopy(online.probe),
            trusted=online.trusted,
            buffer=None
            if buffer.targets is None
            else (buffer.features.clone(), buffer.targets.clone(), buffer.groups),
        )

    @property
    def records(self) -> list[dict]:
        return self.scored


def test_auto_layer_chooses_from_earlier_steps_in_one_pass(tiny_model_path, tmp_path, monkeypatch):
    hook_calls = []
    original = features.PooledCapture.__call__

    def counting(self, module, args, output):
        hook_calls.append(id(module))
        return original(self, module, args, output)

    monkeypatch.setattr(features.PooledCapture, "__call__", counting)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    scoring_passes = _count_scoring_passes(model)
    args = _args(tmp_path)
    trainer = LayerRecorder(model, digit_reward, args=args, train_dataset=digit_dataset())
    trainer.train()
    steps = 5
    assert trainer.estimator.layers == (1, 2, 3)  # round(0.25·4), round(0.53·4) (the fixed default), round(0.75·4)
    records = trainer.records
    assert records[0]["layer"] == 2

    # No pass added (as with a fixed layer): the loss's forward of each step hooks the three candidates once.
    assert scoring_passes[0] == trainer.feature_passes == 0
    assert len(hook_calls) == 3 * steps and all(len(set(hook_calls[i : i + 3])) == 3 for i in range(0, 15, 3))
    assert records[0]["features"].shape == (8, 3, 2 * 128 + 3)

    template = ValueProbe(alpha=args.probe_alpha, pca_dims=[], clip="observed")
    for t in range(1, steps):  # step t+1 (1-based) uses what the buffer held after step t
        record, previous = records[t], records[t - 1]
        bx, by, bg = record["buffer"]
        if t % args.probe_layer_select_every == 0:  # a choice was made after step t from steps <= t only
            mae = grouped_kfold_errors(template, bx, by, bg, args.probe_layer_folds).mean(1).tolist()
            assert record["index"] == choose_layer(mae, previous["index"], args.probe_layer_switch_margin)
        else:
            assert record["index"] == previous["index"]
        # The probe in use was fitted on exactly that buffer, at the layer in use.
        refit = ValueProbe(alpha=args.probe_alpha, pca_dims=[], clip="observed").fit(bx[:, record["index"]], by)
        for key, tensor in refit.state_dict().items():
            torch.testing.assert_close(record["probe"].state_dict()[key], tensor, rtol=1e-9, atol=1e-12)
        if record["trusted"]:
            values = record["probe"].predict(record["features"][:, record["index"]])
            expected = record["rewards"] - values.view(-1, 2).flip(1).reshape(-1)
            torch.testing.assert_close(record["advantages"], expected, atol=2e-4, rtol=1e-4)

    assert len({r["layer"] for r in records}) > 1  # with seed 0 the choice moves (2 -> 3 -> 2): refits on a switch
    logged = [h for h in trainer.state.log_history if "poise/layer" in h]
    assert [h["poise/layer"] for h in logged] == [float(r["layer"]) for r in records]
    with_mae = [i + 1 for i, h in enumerate(logged) if "poise/layer_mae/1" in h]
    assert with_mae == [2, 4]
    assert all(f"poise/layer_mae/{layer}" in logged[1] for layer in (1, 2, 3))


def test_select_layer_hysteresis_and_logging_in_the_trainer(tiny_model_path, tmp_path, monkeypatch):
    trainer = POISETrainer(
        str(tiny_model_path),
        digit_reward,
        args=_args(tmp_path, probe_layer_switch_margin=0.05),
        train_dataset=digit_dataset(),
    )
    assert trainer.estimator.layer_ == 2
    per_layer = {}
    monkeypatch.setattr(OnlineLearner, "layer_errors", lambda self, folds, device=None: per_layer["errors"])
    per_layer["errors"] = torch.tensor([[0.97, 0.97], [1.0, 1.0], [1.5, 1.5]], dtype=torch.float64)  # 3% better
    estimator = trainer.estimator

    def select() -> dict[str, float]:
        learners, layers = [estimator.new_probe("default")], estimator.spec.layers  # its errors: `per_layer`
        layer_index, metrics = select_layer(
            learners, layers.ids, estimator.layer_index_, layers.switch_margin, layers.folds, "cpu"
        )
        estimator.state_ = replace(estimator.state_, layer_index=layer_index)
        return metrics

    assert select() == {"layer_mae/1": 0.97, "layer_mae/2": 1.0, "layer_mae/3": 1.5}
    assert trainer.estimator.layer_ == 2
    per_layer["errors"] = torch.tensor([[0.8, 0.8], [1.0, 1.0], [1.5, 1.5]], dtype=torch.float64)  # 20%: switch
    select()
    assert trainer.estimator.layer_ == 1


def test_saved_probes_record_the_candidate_set(tiny_model_path, tmp_path):
    auto = POISETrainer(str(tiny_model_path), digit_reward, args=_args(tmp_path), train_dataset=digit_dataset())
    auto.estimator.state_ = replace(auto.estimator.state_, layer_index=2)
    auto.save_probe(tmp_path / "auto.safetensors")
    again = POISETrainer(
        str(tiny_model_path),
        digit_reward,
        args=_args(tmp_path, probe_init_path=str(tmp_path / "auto.safetensors")),
        train_dataset=digit_dataset(),
    )
    assert again.estimator.layer_ == 3
    for other in (dict(probe_layer_candidates=[1, 2]), dict(probe_layer=2)):
        with pytest.raises(ValueError, match="fitted on features"):
            POISETrainer(
                str(tiny_model_path),
                digit_reward,
                args=_args(tmp_path, probe_init_path=str(tmp_path / "auto.safetensors"), **other),
                train_dataset=digit_dataset(),
            )
