"""POISETrainer end to end on the tiny model: advantages, forward passes, PEFT, eval, checkpoints, model card."""

import copy
import math
import os
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from poise_trl import POISEConfig, POISETrainer
from poise_trl.estimator.buffer import prompt_group_ids
from poise_trl.estimator.files import read_state
from poise_trl.grpo.trainer import ESTIMATOR_FILE
from poise_trl.heads.logistic import LogisticProbe

from .conftest import CPU_ARGS, digit_reward, poise_args
from .conftest import digit_dataset as _dataset
from .tiny_archs import SpyTrainer, save_causal_lm

MARKER_ID = 3  # `</think>` in the tiny tokenizer


class RecordingTrainer(SpyTrainer):
    """Records, at every scoring step, what an independent recomputation needs: the probe as it was, the batch and
    hidden states from a plain `output_hidden_states=True` pass of the same (not yet updated) model; `SpyTrainer`
    adds the rewards and the advantages POISE gave the batch, whichever capture route gave them (`recorded`)."""

    records: list[dict]

    def _generate_and_score_completions(self, inputs):
        # before the first step nothing is learned: the unfitted probe a new domain starts from
        online = self.estimator.probes_.get("default") or self.estimator.new_probe("default")
        probe = copy.deepcopy(online.probe)
        trusted = probe.is_fitted and self.estimator.steps_ >= self.args.probe_warmup_steps
        output = super()._generate_and_score_completions(inputs)
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], 1)
        mask = torch.cat([output["prompt_mask"], output["completion_mask"]], 1)
        with torch.no_grad():
            out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        self.records.append(
            dict(probe=probe, trusted=trusted, hidden=out.hidden_states[self.estimator.layer_ + 1], logits=out.logits)
        )
        return output

    @property
    def recorded(self) -> list[dict]:
        """Each training batch's record with its `scored` entry (output, rewards, advantages)."""
        return [{**record, **scored} for record, scored in zip(self.records, self.scored, strict=True)]


def _independent_features(record: dict, n: int) -> torch.Tensor:
    """φ recomputed row by row on unpadded tokens, without any of poise_trl.features.features."""
    out, hidden, logits = record["output"], record["hidden"], record["logits"]
    p_len = out["prompt_ids"].size(1)
    rows = []
    for i in range(hidden.size(0)):
        p_count = int(out["prompt_mask"][i].sum())
        completion = out["completion_ids"][i][out["completion_mask"][i].bool()].tolist()
        markers = [j for j, tok in enumerate(completion) if tok == MARKER_ID]
        reasoning_len = markers[-1] + 1 if markers else len(completion)
        h_prompt = hidden[i, p_len - p_count : p_len]
        h_reasoning = hidden[i, p_len : p_len + reasoning_len]
        log_p = torch.log_softmax(logits[i, p_len - 1 : p_len - 1 + len(completion)].float(), -1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        answer = entropy[reasoning_len:] if markers else entropy[-n:]
        stats = [entropy.mean(), entropy[:reasoning_len].mean(), answer.mean() if len(answer) else torch.tensor(0.0)]
        rows.append(torch.cat([h_prompt[-n:].mean(0), h_reasoning[-n:].mean(0), torch.stack(stats)]))
    return torch.stack(rows)


def test_train_changes_every_parameter_and_advantages_use_the_partner(tiny_model_path, tmp_path):
    args = poise_args(tmp_path, max_steps=5, probe_pool_tokens=3)
    trainer = RecordingTrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=_dataset())
    trainer.records = []
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n: not torch.equal(before[n], p) for n, p in trainer.model.named_parameters()}
    assert all(changed.values()), [n for n, c in changed.items() if not c]

    recorded = trainer.recorded
    trusted = [r for r in recorded if r["trusted"]]
    assert len(trusted) >= 3 and not recorded[0]["trusted"]
    for record in trusted:
        features = _independent_features(record, n=3)
        values = record["probe"].predict(features)
        baselines = values.view(-1, 2).flip(1).reshape(-1)  # b1 = g(phi2), b2 = g(phi1)
        expected = record["rewards"] - baselines
        torch.testing.assert_close(record["advantages"], expected, atol=2e-4, rtol=1e-4)
    for record in recorded[:1]:  # bootstrap: the partner's reward (RLOO for G=2)
        rewards = record["rewards"]
        torch.testing.assert_close(record["advantages"], rewards - rewards.view(-1, 2).flip(1).reshape(-1))

    logged = [h for h in trainer.state.log_history if "poise/mae" in h]
    assert len(logged) == 5
    for key in ("poise/value_mean", "poise/variance_reduction", "poise/pearson_r", "poise/buffer_size"):
        assert any(h.get(key) is not None for h in logged), key
    assert [h["poise/bootstrap"] for h in logged] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert logged[-1]["poise/buffer_size"] == 5 * 8
    assert list(trainer._logs["advantages"]) == pytest.approx(recorded[-1]["advantages"].tolist())
    received = torch.cat([a.flatten() for a in trainer.loss_advantages])  # what the loss read, micro-batch order
    assert torch.equal(received.sort().values, torch.cat([r["advantages"] for r in recorded]).sort().values)
    assert len(trainer._logs["extra"]["baseline"]) == 8


def _count_scoring_passes(model) -> list[int]:
    """Count no-grad teacher-forced calls (TRL's log-prob passes pass `labels`), not generation steps."""
    calls = [0]

    def hook(module, args, kwargs):
        if "labels" in kwargs and not torch.is_grad_enabled():
            calls[0] += 1

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


@pytest.mark.parametrize(
    ("num_iterations", "capture", "extra_passes"), [(1, "auto", 0), (1, "pass", 1), (2, "auto", 0), (2, "pass", 0)]
)
def test_forward_pass_count(tiny_model_path, tmp_path, num_iterations, capture, extra_passes):
    """No-grad teacher-forced passes against GRPOTrainer's: none added where TRL runs its own (num_iterations=2) or
    where POISE reads the loss's forward (TRL's default, `probe_capture="auto"`); one a generation with "pass"."""
    steps = 4
    common = dict(max_steps=steps, num_iterations=num_iterations)
    counts = {}
    for name, trainer_cls, config_cls in [("grpo", GRPOTrainer, GRPOConfig), ("poise", POISETrainer, POISEConfig)]:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        calls = _count_scoring_passes(model)
        args = (
            poise_args(tmp_path, probe_capture=capture, **common)
            if config_cls is POISEConfig
            else GRPOConfig(
                **{
                    **CPU_ARGS,
                    "output_dir": str(tmp_path / "g"),
                    "per_device_train_batch_size": 8,
                    "max_steps": steps,
                    "max_completion_length": 6,
                    "num_generations": 2,
                    "num_iterations": num_iterations,
                }
            )
        )
        trainer = trainer_cls(model, digit_reward, args=args, train_dataset=_dataset())
        trainer.train()
        counts[name] = calls[0]
        if name == "poise":
            generations = steps // num_iterations
            assert trainer.feature_passes == generations * extra_passes
    assert counts["poise"] - counts["grpo"] == (steps // num_iterations) * extra_passes


def test_peft_keeps_base_frozen_and_trains_lora(tiny_model_path, tmp_path):
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = POISETrainer(
        str(tiny_model_path),
        digit_reward,
        args=poise_args(tmp_path),
        train_dataset=_dataset(),
        peft_config=peft_config,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    for name, param in trainer.model.named_parameters():
        if "lora" in name:
            assert not torch.equal(before[name], param), name
        else:
            assert torch.equal(before[name], param), name
    assert len(trainer.estimator.probes_["default"].buffer) > 0


def test_eval_does_not_touch_the_buffer(tiny_model_path, tmp_path):
    args = poise_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    trainer = POISETrainer(
        str(tiny_model_path), digit_reward, args=args, train_dataset=_dataset(), eval_dataset=_dataset(8)
    )
    trainer.train()
    buffer, steps = trainer.estimator.probes_["default"].buffer.targets.clone(), trainer.estimator.steps_
    metrics = trainer.evaluate()
    assert (
        torch.equal(trainer.estimator.probes_["default"].buffer.targets, buffer) and trainer.estimator.steps_ == steps
    )
    assert "eval_poise/mae" in metrics


def test_resume_restores_probe_buffer_and_next_baselines_bit_for_bit(tiny_model_path, tmp_path):
    args = poise_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=3)
    uninterrupted = RecordingTrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=_dataset())
    uninterrupted.records = []
    uninterrupted.train()
    checkpoint = tmp_path / "out" / "checkpoint-3"
    info = read_state(checkpoint / ESTIMATOR_FILE)["info"]
    assert info["feature_config"]["probe_layer"] == uninterrupted.estimator.layer_ == 2 and info["probe_steps"] == 3

    resumed = RecordingTrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=_dataset())
    resumed.records = []
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert len(resumed.records) == 1  # only step 4 ran
    before, after = uninterrupted.records[3], resumed.records[0]
    assert before["probe"].state_dict().keys() == after["probe"].state_dict().keys()
    for key, tensor in before["probe"].state_dict().items():
        assert torch.equal(tensor, after["probe"].state_dict()[key]), key
    assert torch.equal(uninterrupted.recorded[3]["advantages"], resumed.recorded[0]["advantages"])
    resumed_buffer, uninterrupted_buffer = (t.estimator.probes_["default"].buffer for t in (resumed, uninterrupted))
    assert torch.equal(resumed_buffer.features, uninterrupted_buffer.features)
    assert resumed.estimator.steps_ == uninterrupted.estimator.steps_ == 4

    changed = POISETrainer(
        str(tiny_model_path),
        digit_reward,
        args=poise_args(tmp_path, max_steps=4, probe_layer=1),
        train_dataset=_dataset(),
    )
    with pytest.raises(ValueError, match="fitted on features"):
        changed.train(resume_from_checkpoint=str(checkpoint))


def test_model_card_and_bad_inputs(tiny_model_path, tmp_path):
    trainer = POISETrainer(str(tiny_model_path), digit_reward, args=poise_args(tmp_path), train_dataset=_dataset())
    trainer.create_model_card(model_name="tiny-poise")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "POISE" in card and "2605.07579" in card
    assert trainer._tag_names == ["trl", "poise"]
    with pytest.raises(ValueError, match=r"\[-4, 3\]"):
        POISETrainer(
            str(tiny_model_path), digit_reward, args=poise_args(tmp_path, probe_layer=4), train_dataset=_dataset()
        )
    with pytest.raises(ValueError, match="only 128 columns"):
        POISETrainer(
            str(tiny_model_path),
            digit_reward,
            args=poise_args(tmp_path, probe_pca_dims=[200, 0]),
            train_dataset=_dataset(),
        )
    # A GRPOConfig is converted (tests/test_migration.py); anything else is refused.
    with pytest.raises(TypeError, match="needs a POISEConfig or a GRPOConfig, got dict"):
        POISETrainer(str(tiny_model_path), digit_reward, args={"output_dir": str(tmp_path)}, train_dataset=_dataset())


@pytest.mark.parametrize(
    "extra",
    [
        dict(num_iterations=2, beta=0.04, gradient_checkpointing=True),
        dict(num_iterations=1, beta=0.04, gradient_checkpointing=True),
    ],
)
def test_hooks_capture_one_policy_pass_and_never_leak(tiny_model_path, tmp_path, monkeypatch, extra):
    """With PEFT and beta > 0 the reference pass runs the same modules (adapters disabled); generation does too.
    Only the one policy pass per step may be captured, and no hook may survive `train()`."""
    from poise_trl.features import features

    rows_captured = []
    original = features.PooledCapture.__call__

    def counting(self, module, args, output):
        rows_captured.append((output[0] if isinstance(output, tuple) else output).size(0))
        return original(self, module, args, output)

    monkeypatch.setattr(features.PooledCapture, "__call__", counting)
    peft_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = poise_args(tmp_path, max_steps=4, **extra)
    trainer = POISETrainer(
        str(tiny_model_path), digit_reward, args=args, train_dataset=_dataset(), peft_config=peft_config
    )
    trainer.train()
    generations = 4 // args.num_iterations
    assert sum(rows_captured) == generations * 8  # one pass over each step's 8 rollouts, nothing else
    leftover = [
        name
        for name, module in trainer.model.named_modules()
        if any(isinstance(h, features.PooledCapture) for h in module._forward_hooks.values())
    ]
    assert leftover == []
    assert trainer.feature_passes == 0  # TRL's pass (num_iterations=2) or the loss's forward served


@pytest.mark.parametrize("include_buffer", [True, False])
def test_warm_start_uses_the_loaded_probe_from_the_first_step(tiny_model_path, tmp_path, include_buffer):
    first = POISETrainer(
        str(tiny_model_path), digit_reward, args=poise_args(tmp_path, max_steps=3), train_dataset=_dataset()
    )
    first.train()
    path = tmp_path / "exported.safetensors"
    first.save_probe(path, include_buffer=include_buffer)

    args = poise_args(tmp_path, max_steps=2, probe_warmup_steps=4, probe_init_path=str(path), seed=1)
    second = RecordingTrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=_dataset())
    second.records = []
    second.train()
    loaded = second.records[0]["probe"]
    for key, tensor in first.estimator.probes_["default"].probe.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    assert [h["poise/bootstrap"] for h in second.state.log_history if "poise/bootstrap" in h] == [0.0, 0.0]
    record = second.recorded[0]
    baselines = loaded.predict(_independent_features(record, n=10)).view(-1, 2).flip(1).reshape(-1)
    torch.testing.assert_close(record["advantages"], record["rewards"] - baselines, atol=2e-4, rtol=1e-4)
    # Without its buffer the loaded fit is kept (not refitted on a handful of rows) during probe_warmup_steps.
    coefs = [t.estimator.probes_["default"].probe.state_dict()["coef"] for t in (first, second)]
    refitted = not torch.equal(*coefs)
    assert refitted == include_buffer
    assert len(second.estimator.probes_["default"].buffer) == (3 * 8 if include_buffer else 0) + 2 * 8


def test_the_probe_reads_the_rollout_scalars_it_is_given(tiny_model_path, tmp_path):
    """probe_scalars: φ holds the chosen scalars after the pooled states, as recomputed row by row from the batch's
    tokens and a plain pass's entropies (the answer: after the last marker, else the last n tokens)."""
    scalars = ["answer_max_token_entropy", "output_length", "output_repetition_ratio"]
    args = poise_args(tmp_path, max_steps=1, probe_pool_tokens=3, probe_scalars=scalars)
    trainer = RecordingTrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=_dataset())
    trainer.records = []
    trainer.train()
    record, buffered = trainer.recorded[0], trainer.estimator.probes_["default"].buffer.features[:, 0]
    out, logits, width = record["output"], record["logits"], 2 * trainer.hidden_size
    assert buffered.shape == (8, width + len(scalars))  # the paper's probe: no partner-reward column
    p_len = out["prompt_ids"].size(1)
    for i in range(8):
        completion = out["completion_ids"][i][out["completion_mask"][i].bool()].tolist()
        log_p = torch.log_softmax(logits[i, p_len - 1 : p_len - 1 + len(completion)].float(), -1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        markers = [j for j, tok in enumerate(completion) if tok == MARKER_ID]
        answer = entropy[markers[-1] + 1 :] if markers else entropy[-3:]
        expected = [
            answer.max().item() if len(answer) else 0.0,
            len(completion),
            1 - len(set(completion)) / len(completion) if completion else 0.0,
        ]
        torch.testing.assert_close(buffered[i, width:], torch.tensor(expected), atol=2e-4, rtol=1e-4)


def test_warm_start_refuses_a_probe_from_another_feature_space(tiny_model_path, tmp_path):
    first = POISETrainer(
        str(tiny_model_path), digit_reward, args=poise_args(tmp_path, max_steps=1), train_dataset=_dataset()
    )
    first.train()
    first.save_probe(tmp_path / "p.safetensors")
    with pytest.raises(ValueError, match="fitted on features"):
        POISETrainer(
            str(tiny_model_path),
            digit_reward,
            args=poise_args(tmp_path, probe_pool_tokens=5, probe_init_path=str(tmp_path / "p.safetensors")),
            train_dataset=_dataset(),
        )


@pytest.fixture(scope="module")
def small_model_path(tmp_path_factory):
    """A hidden-16, 2-layer Qwen3: for tests about the probe's files, where the model's size does not matter."""
    return save_causal_lm(tmp_path_factory.mktemp("small") / "qwen3")


def test_a_logistic_head_gives_the_baselines_and_is_saved_by_name(small_model_path, tmp_path):
    args = poise_args(tmp_path, max_steps=3, probe_head="logistic", probe_partner_reward=True)
    trainer = POISETrainer(str(small_model_path), digit_reward, args=args, train_dataset=_dataset())
    trainer.train()
    probe = trainer.estimator.probes_["default"].probe
    assert type(probe) is LogisticProbe and probe.is_fitted
    logged = [h for h in trainer.state.log_history if "poise/bootstrap" in h]
    assert logged[-1]["poise/bootstrap"] == 0.0 and math.isfinite(logged[-1]["poise/mae"])
    trainer.save_probe(tmp_path / "probe.safetensors")
    assert read_state(tmp_path / "probe.safetensors")["info"]["domains"][0]["head"] == "logistic"


def test_a_short_run_with_the_prompt_history_feeds_it_to_the_probe_and_names_it(small_model_path, tmp_path):
    """Four prompts, each drawn at every step: from the second step on, a prompt's rows carry its earlier rewards
    (after the partner's reward); the file and the model card name the history, and a run without it refuses the
    file."""
    args = poise_args(tmp_path, max_steps=3, probe_history=True, probe_partner_reward=True)
    prompts = _dataset(4)
    trainer = POISETrainer(str(small_model_path), digit_reward, args=args, train_dataset=prompts)
    trainer.train()
    seen, count, _ = trainer.estimator.prompt_history_.lookup(prompt_group_ids(prompts["prompt"]))
    assert seen.all() and count.tolist() == [3 * 2] * 4  # 3 steps x 2 rollouts
    rows = trainer.estimator.probes_["default"].buffer.features[:, 0]
    assert rows.size(-1) == 2 * trainer.hidden_size + 3 + 1 + 3  # [φ | r | seen, log(1 + count), mean]
    assert rows[:8, -3].eq(0).all() and rows[8:, -3].eq(1).all()  # unseen at the first step only
    assert rows[-8:, -2].tolist() == pytest.approx([math.log1p(2 * 2)] * 8)  # the last step read two steps' rewards
    trainer.save_probe(tmp_path / "history.safetensors")
    assert read_state(tmp_path / "history.safetensors")["info"]["history"]["steps"] == 3
    trainer.create_model_card(model_name="tiny-poise")
    assert (
        "Prompt history (probe_history): on (65536 prompts, decay 1.0)" in (tmp_path / "out" / "README.md").read_text()
    )
    without = poise_args(tmp_path, probe_partner_reward=True, probe_init_path=str(tmp_path / "history.safetensors"))
    with pytest.raises(ValueError, match="probe_history=True, but this run sets probe_history=False"):
        POISETrainer(str(small_model_path), digit_reward, args=without, train_dataset=prompts)


def test_resume_refuses_changed_probe_settings_and_warm_start_refits_with_the_run_s(small_model_path, tmp_path):
    """A loaded probe never replaces the run's alpha, PCA dims or clip range: on resume a mismatch is an error that
    names both; on warm start the loaded fit predicts as saved and every later refit uses the run's settings. The
    batch-scaling reward std resumes too."""
    saved = dict(max_steps=2, save_strategy="steps", save_steps=2, probe_alpha=0.5, scale_rewards="batch")
    first = POISETrainer(
        str(small_model_path), digit_reward, args=poise_args(tmp_path, **saved), train_dataset=_dataset()
    )
    first.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"

    def resume(**changed):
        args = poise_args(tmp_path, **{**saved, "max_steps": 3, **changed})
        return SpyTrainer(str(small_model_path), digit_reward, args=args, train_dataset=_dataset())

    with pytest.raises(ValueError, match=r"refits with probe_head='ridge', probe_alpha=0.5, .* but this run sets "):
        resume(probe_alpha=2.0).train(resume_from_checkpoint=str(checkpoint))
    with pytest.raises(ValueError, match=r"this run sets probe_head='logistic', probe_alpha=0.5"):
        resume(probe_head="logistic").estimator.load(checkpoint / ESTIMATOR_FILE)
    with pytest.raises(ValueError, match=r"probe_pca_dims=\[0, 0\], .* this run sets .*probe_pca_dims=\[4, 0\]"):
        resume(probe_pca_dims=[4, 0]).estimator.load(checkpoint / ESTIMATOR_FILE)  # what resuming calls
    with pytest.raises(ValueError, match=r"probe_clip_range=None, .* this run sets .*probe_clip_range=\[0.0, 0.5\]"):
        resume(probe_clip_range=[0.0, 0.5]).estimator.load(checkpoint / ESTIMATOR_FILE)
    resumed = resume()
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert [float(s["divisor"]) for s in resumed.scored] == [
        float(first.estimator.reward_std_.divisor())
    ] and resumed.estimator.reward_std_.count == 24

    run = dict(probe_alpha=2.0, probe_pca_dims=[4, 0], probe_clip_range=[0.0, 0.5], max_steps=1)
    warm = POISETrainer(
        str(small_model_path),
        digit_reward,
        args=poise_args(tmp_path, probe_init_path=str(checkpoint / ESTIMATOR_FILE), **run),
        train_dataset=_dataset(),
    )
    probe = warm.estimator.probes_["default"].probe
    assert torch.equal(probe.state_dict()["coef"], first.estimator.probes_["default"].probe.state_dict()["coef"])
    assert (probe.alpha, probe.pca_dims, probe.clip) == (
        2.0,
        [(0, 16, 4)],
        (0.0, 0.5),
    )
    assert warm.estimator.reward_std_.count == 0  # a warm start is a new run
    warm.train()
    refitted = warm.estimator.probes_["default"].probe
    assert refitted.fitted_pca_dims == [4] and refitted.state_dict()["clip"].tolist() == [0.0, 0.5]


def test_the_probe_is_in_the_checkpoint_before_it_is_pushed(small_model_path, tmp_path):
    """With push_to_hub, the parent pushes the checkpoint folder inside `_save_checkpoint`; the probe must be there."""
    args = poise_args(tmp_path, max_steps=1, save_strategy="steps", save_steps=1, hub_strategy="checkpoint")
    trainer = POISETrainer(str(small_model_path), digit_reward, args=args, train_dataset=_dataset())
    trainer.args.push_to_hub = True  # after construction, so no Hub repository is created (no network)
    pushed = []
    trainer._push_from_checkpoint = lambda folder: pushed.append(sorted(os.listdir(folder)))
    trainer.train()
    assert len(pushed) == 1 and {ESTIMATOR_FILE, "trainer_state.json"} <= set(pushed[0])


def test_save_model_keeps_the_probe_and_a_new_run_starts_from_the_folder_trusted(tiny_model_path, tmp_path):
    """`save_model` (and so `push_to_hub`) writes the estimator's file beside the weights; `probe_init_path` takes the
    folder, and a run fine-tuning the saved model again uses the saved probe from its first step."""
    first = POISETrainer(
        str(tiny_model_path), digit_reward, args=poise_args(tmp_path, max_steps=2), train_dataset=_dataset()
    )
    first.train()
    first.create_model_card()
    assert (
        "the probe is not saved beside the weights; `trainer.save_model()` writes it"
        in (tmp_path / "out" / "README.md").read_text()
    )
    saved = tmp_path / "saved"
    first.save_model(str(saved))
    assert {ESTIMATOR_FILE, "model.safetensors", "config.json"} <= set(os.listdir(saved))
    first.save_model()  # the output folder, as `push_to_hub` saves before uploading it
    first.create_model_card()
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"Warm start: the probe is saved beside the weights (`{ESTIMATOR_FILE}`); " in card
    assert (tmp_path / "out" / ESTIMATOR_FILE).exists()

    args = poise_args(tmp_path / "again", max_steps=1, probe_warmup_steps=4, probe_init_path=str(saved), seed=1)
    second = POISETrainer(str(saved), digit_reward, args=args, train_dataset=_dataset())
    trained = first.estimator.probes_["default"].probe.state_dict()
    loaded = second.estimator.probes_["default"]
    assert loaded.trusted and all(torch.equal(loaded.probe.state_dict()[k], t) for k, t in trained.items())
    second.train()
    assert [h["poise/bootstrap"] for h in second.state.log_history if "poise/bootstrap" in h] == [0.0]
    with pytest.raises(FileNotFoundError, match=rf"is a folder without {ESTIMATOR_FILE}: give a folder"):
        POISETrainer(
            str(saved),
            digit_reward,
            args=poise_args(tmp_path, probe_init_path=str(tmp_path)),
            train_dataset=_dataset(),
        )


def test_vllm_importance_sampling_pass_is_reused_for_capture(tiny_model_path, tmp_path):
    """vLLM needs CUDA; at its boundary, TRL's IS-correction old-log-prob pass must be recognised as capturable."""
    trainer = POISETrainer(str(tiny_model_path), digit_reward, args=poise_args(tmp_path), train_dataset=_dataset())
    assert not trainer._trl_runs_old_logps_pass()
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    assert trainer._trl_runs_old_logps_pass()
    trainer.vllm_importance_sampling_correction = False
    assert not trainer._trl_runs_old_logps_pass()


def test_warm_start_accepts_a_single_probe_file(tiny_model_path, tmp_path):
    """`save_probe_file` (one probe, (N, D) buffer, e.g. exported by the probe benchmark) warm-starts a fixed-layer run
    as its one domain."""
    from poise_trl.estimator.buffer import ProbeBuffer
    from poise_trl.estimator.files import save_probe_file
    from poise_trl.heads.probe import ValueProbe

    trainer = POISETrainer(str(tiny_model_path), digit_reward, args=poise_args(tmp_path), train_dataset=_dataset())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 2 * 128 + 3, generator=g), torch.rand(16, generator=g)
    probe, buffer = ValueProbe(alpha=0.01).fit(x, y), ProbeBuffer(32)
    buffer.add(x, y)
    features = dict(trainer.estimator.feature_config)  # keep only what such a file has: the single layer, no domains
    for key in ("probe_layer_candidates", "probe_domain_column"):
        features.pop(key)
    metadata = {"feature_config": features, "model_name": "tiny", "probe_steps": 0}
    save_probe_file(tmp_path / "single.safetensors", probe, buffer, metadata)
    args = poise_args(tmp_path, probe_init_path=str(tmp_path / "single.safetensors"))
    warm = POISETrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=_dataset())
    loaded = warm.estimator.probes_["default"]
    assert torch.equal(loaded.probe.state_dict()["coef"], probe.state_dict()["coef"])
    assert loaded.buffer.features.shape == (16, 1, 2 * 128 + 3) and loaded.trusted


def test_untested_trl_release_fails_at_import_with_what_to_do():
    """POISETrainer overrides GRPOTrainer internals: another TRL minor release must fail loudly, not misbehave."""
    code = "import trl; trl.__version__ = '1.17.0'; import poise_trl; poise_trl.POISETrainer"
    env = {k: v for k, v in os.environ.items() if k != "POISE_ALLOW_UNTESTED_TRL"}
    refused = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    assert "ImportError: poise-trl is tested with trl>=1.16.0,<1.17.0 but trl 1.17.0 is installed" in refused.stderr
    assert "POISE_ALLOW_UNTESTED_TRL=1" in refused.stderr
    allowed = subprocess.run(
        [sys.executable, "-c", code], env={**env, "POISE_ALLOW_UNTESTED_TRL": "1"}, capture_output=True, timeout=120
    )
    assert allowed.returncode == 0, allowed.stderr[-2000:]
