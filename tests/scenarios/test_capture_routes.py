"""The capture routes give the same numbers: where TRL runs no log-prob pass, POISE reads its features from the loss's
own forward (`probe_capture="auto"`) instead of a no-grad pass of its own (`"pass"`), and a step then runs exactly the
forwards GRPOTrainer runs.

Each setting trains the tiny model for a few steps once per route, on CPU in float32 (the tiny Qwen3 has no dropout,
so both routes' forwards see the same states), and compares what every micro-batch's loss received (advantages, loss
value), the trained weights and the estimator the run leaves. Settings share runs: each exercises several options."""

import logging

import pytest
import torch
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from poise_trl import POISETrainer

from ..conftest import CPU_ARGS, digit_dataset, digit_reward, short_args
from ..tiny_archs import env_rollout

RTOL = 1e-6  # stated tolerance; on this CPU every compared number was bit-identical


class Tracking(POISETrainer):
    """Records each micro-batch's advantages and loss as TRL's loss received and computed them."""

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if self.model.training:
            self.received.append((inputs["advantages"].detach().clone(), loss.detach().clone()))
        return loss


def _train(model, tmp_path, route: str, peft: bool = False, rollout=None, **overrides) -> Tracking:
    args = short_args(tmp_path / route, probe_capture=route, max_steps=3, **overrides)
    trainer = Tracking(
        str(model),
        digit_reward,
        args=args,
        train_dataset=digit_dataset(),
        rollout_func=rollout,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if peft else None,
    )
    trainer.received = []
    trainer.initial = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
    trainer.train()
    return trainer


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    scale = max(1.0, b.abs().max().item() if b.numel() else 0.0)
    torch.testing.assert_close(a, b, rtol=RTOL, atol=RTOL * scale, equal_nan=True)


def _assert_same_run(loss: Tracking, own: Tracking) -> None:
    assert loss._capture_route("train") == "loss" and own._capture_route("train") == "own_pass"
    assert loss.feature_passes == 0 and own.feature_passes == own.state.global_step
    assert len(loss.received) == len(own.received) > 0
    for (a, la), (b, lb) in zip(loss.received, own.received, strict=True):
        assert torch.isfinite(a).all()
        _close(a, b)
        _close(la, lb)
    assert any(a.abs().sum() > 0 for a, _ in loss.received)  # the setting trains: some advantage is not 0 ...
    trained = [p.detach() for p in loss.model.parameters() if p.requires_grad]
    assert any(not torch.equal(p, q) for p, q in zip(trained, loss.initial, strict=True))  # ... and moves weights
    for p, q in zip(loss.model.parameters(), own.model.parameters(), strict=True):
        if p.requires_grad:
            _close(p.detach(), q.detach())
    saved, other = loss.estimator.state_dict(), own.estimator.state_dict()
    assert saved["info"] == other["info"]
    assert saved["tensors"].keys() == other["tensors"].keys()
    for key, value in saved["tensors"].items():
        _close(value.double(), other["tensors"][key].double())
    assert _poise_logs(loss) == _poise_logs(own)


def _poise_logs(trainer: Tracking) -> list[dict[str, float]]:
    """The `poise/*` figures the run logged (less the refit's wall time)."""
    return [
        {k: v for k, v in h.items() if k.startswith("poise/") and k != "poise/probe_fit_seconds"}
        for h in trainer.state.log_history
    ]


def _tool_rollout():
    """Completions that interleave the policy's tokens with environment feedback (`env_mask` 0); a group's two
    completions end in answers of different lengths, so their rewards differ and the setting trains."""
    return env_rollout(lambda i: [(f"{i}</think>", 1), ("feedback</think>", 0), (f"{i % 3}" * (1 + i % 2), 1)])


SETTINGS = {
    # two micro-batches per generation batch (whole-group shuffle), recomputed forwards, a micro-batch token count
    "accumulation+checkpointing+bnpo+history": dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        gradient_checkpointing=True,
        loss_type="bnpo",
        probe_history=True,
    ),
    # importance weights on the advantages and on dapo's token count, LoRA, unbiased reward scaling
    "lora+importance+dapo+scale": dict(
        peft=True,
        prompt_selection="importance",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        probe_warmup_steps=1,
        scale_rewards="batch",
    ),
    "prefix+grpo": dict(
        probe_granularity="prefix",
        probe_warmup_steps=1,
        loss_type="grpo",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
    ),
    # every micro-batch trained twice (its first forward captures it), three rollouts a prompt, several layers
    "auto-layers+G3+iterations+dr_grpo": dict(
        probe_layer="auto",
        probe_layer_select_every=1,
        num_generations=3,
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        steps_per_generation=1,
        num_iterations=2,
        loss_type="dr_grpo",
    ),
    "tool-mask+cispo": dict(
        rollout=_tool_rollout(), loss_type="cispo", probe_features=["prompt", "reasoning", "entropy", "length"]
    ),
    "sapo+rloo": dict(loss_type="sapo", probe_bootstrap="rloo", probe_partner_reward=False),
    "luspo+G4": dict(loss_type="luspo", num_generations=4, per_device_train_batch_size=8),
    "vespo+paper": dict(loss_type="vespo", probe_preset="paper"),
}


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_loss_forward_gives_the_numbers_of_the_extra_pass(tiny_model_path, tmp_path, setting):
    overrides = SETTINGS[setting]
    _assert_same_run(
        _train(tiny_model_path, tmp_path, "auto", **overrides), _train(tiny_model_path, tmp_path, "pass", **overrides)
    )


def _teacher_forced_passes(trainer) -> list[int]:
    """Counts the policy's teacher-forced forwards (TRL's log-prob calls pass `fused_lm_head`; generation does not)."""
    calls = [0]

    def count(module, args, kwargs):
        calls[0] += "fused_lm_head" in kwargs

    trainer.model.register_forward_pre_hook(count, with_kwargs=True)
    return calls


@pytest.mark.slow
def test_in_trls_default_configuration_poise_runs_the_forwards_grpo_runs(tiny_model_path, tmp_path):
    counts = {}
    for name, extra in [("grpo", None), ("poise", "auto"), ("poise-pass", "pass")]:
        if extra is None:  # the same CPU setting, for TRL's trainer; G=2 as POISE's
            base = dict(per_device_train_batch_size=4, max_steps=3, max_completion_length=6, seed=0, num_generations=2)
            args = GRPOConfig(output_dir=str(tmp_path / name), **CPU_ARGS, **base)
            trainer = GRPOTrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
        else:
            args = short_args(tmp_path / name, max_steps=3, probe_capture=extra)
            trainer = POISETrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
        calls = _teacher_forced_passes(trainer)
        trainer.train()
        counts[name] = calls[0]
    assert counts["grpo"] == 3  # one loss forward a step: TRL runs no log-prob pass here
    assert counts["poise"] == counts["grpo"]
    assert counts["poise-pass"] == counts["grpo"] + 3  # the route it replaces: one more pass a step


@pytest.mark.slow
def test_a_layout_that_splits_groups_falls_back_to_a_pass_and_says_so_once(tiny_model_path, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="poise_trl.grpo.trainer"):
        trainer = _train(
            tiny_model_path, tmp_path, "auto", per_device_train_batch_size=3, gradient_accumulation_steps=2
        )
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "not a multiple of num_generations=2" in caplog.records[0].message
    assert trainer._capture_route("train") == "own_pass" and trainer.feature_passes == 3


@pytest.mark.slow
def test_evaluation_reads_the_eval_loss_forward_too(tiny_model_path, tmp_path):
    evaluation = dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
    runs = {}
    for route in ("auto", "pass"):
        args = short_args(tmp_path / route, probe_capture=route, max_steps=2, **evaluation)
        trainer = POISETrainer(
            str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset(), eval_dataset=digit_dataset(4)
        )
        trainer.train()
        runs[route] = [
            {k: v for k, v in h.items() if k.startswith("eval_") and "runtime" not in k and "per_second" not in k}
            for h in trainer.state.log_history
            if "eval_loss" in h
        ]
        assert trainer._capture_route("eval") == ("loss" if route == "auto" else "own_pass")
    assert runs["auto"] == runs["pass"] and len(runs["auto"]) == 2
    assert "eval_poise/reward_mean" in runs["auto"][0]


@pytest.mark.slow
def test_probe_files_of_either_route_warm_start_the_other(tiny_model_path, tmp_path):
    first = {route: _train(tiny_model_path, tmp_path / "first", route) for route in ("auto", "pass")}
    for route, other in (("auto", "pass"), ("pass", "auto")):
        path = tmp_path / f"{route}.safetensors"
        first[route].save_probe(path)
        warm = _train(tiny_model_path, tmp_path / f"warm-{route}", other, probe_init_path=str(path))
        assert warm.estimator.trusted_
    warm_from = {r: tmp_path / f"{r}.safetensors" for r in ("auto", "pass")}
    assert warm_from["auto"].read_bytes() == warm_from["pass"].read_bytes()  # the same run, the same file


@pytest.mark.slow
def test_checkpoints_of_the_loss_route_fall_between_generation_batches_and_resume_exactly(tiny_model_path, tmp_path):
    """Two generation batches of two micro-batches each per optimizer step: every checkpoint is saved after a whole
    generation batch was observed, so it needs no features of trained micro-batches, and a resumed run ends as the
    uninterrupted one."""
    settings = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        steps_per_generation=2,
        save_strategy="steps",
        save_steps=1,
    )
    whole = _train(tiny_model_path, tmp_path / "whole", "auto", **settings)
    assert whole._capture_route("train") == "loss" and whole._regroups("train")
    checkpoint = tmp_path / "whole" / "auto" / "out" / "checkpoint-1"
    assert not list(checkpoint.glob("poise_generation_batch-*"))
    args = short_args(tmp_path / "resumed", probe_capture="auto", max_steps=3, **settings)
    resumed = POISETrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for p, q in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert whole.estimator.state_dict()["info"] == resumed.estimator.state_dict()["info"]
