"""POISETrainer as a drop-in GRPOTrainer: the scenarios a GRPOTrainer user runs, on tiny local models of several
architectures (Qwen3, Llama, Qwen3-MoE, Mixtral; hidden size 8-16). Every training run checks that POISE's
advantages, not GRPO's, reach TRL's loss."""

import math

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from poise_trl import POISEConfig, POISETrainer

from ..conftest import CPU_ARGS, short_args
from ..tiny_archs import (
    SpyTrainer,
    assert_poise_advantages_reach_the_loss,
    char_tokenizer,
    code_reward,
    prompts,
    save_causal_lm,
    save_reward_model,
)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    """Saved tiny models: each architecture at hidden size 16, Qwen3 also at 8, and a reward model."""
    root = tmp_path_factory.mktemp("archs")
    out = {arch: save_causal_lm(root / arch, arch) for arch in ("qwen3", "llama", "qwen3_moe", "mixtral")}
    out["qwen3_h8"] = save_causal_lm(root / "qwen3_h8", "qwen3", hidden_size=8)
    out["reward"] = save_reward_model(root / "reward")
    return out


def _assert_trained(trainer: SpyTrainer, before: dict[str, torch.Tensor]) -> None:
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)]
    assert changed, "no parameter changed"
    logged = [h for h in trainer.state.log_history if "poise/bootstrap" in h]
    assert [h["poise/bootstrap"] for h in logged] == [1.0, 0.0]  # RLOO first, then the probe's baselines
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_poise_advantages_reach_the_loss(trainer)


def _train(trainer: SpyTrainer) -> SpyTrainer:
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    _assert_trained(trainer, before)
    return trainer


def test_minimal_init_and_the_default_preset_on_hidden_size_8(paths, tmp_path):
    """Model and reward model by path, nothing else but the CPU settings: the release preset's PCA dims (32, 64) are
    capped at the 8 columns of each hidden block; explicit dims wider than the block still fail early."""
    args = POISEConfig(output_dir=str(tmp_path), **CPU_ARGS)
    trainer = POISETrainer(
        model=str(paths["qwen3_h8"]), reward_funcs=str(paths["reward"]), args=args, train_dataset=prompts()
    )
    head = trainer.estimator.new_probe("default").probe
    assert trainer.hidden_size == 8 and head.pca_dims == [(0, 8, 8), (8, 16, 8)]
    explicit = POISEConfig(output_dir=str(tmp_path), probe_pca_dims=[32, 0], **CPU_ARGS)
    with pytest.raises(ValueError, match="32 components of the prompt block, which has only 8 columns"):
        POISETrainer(str(paths["qwen3_h8"]), code_reward, args=explicit, train_dataset=prompts())


@pytest.mark.parametrize(
    ("arch", "conversational"),
    [("qwen3", False), ("qwen3_h8", True), ("llama", True), ("qwen3_moe", False), ("mixtral", True)],
)
def test_training_on_each_architecture_and_dataset_format(paths, tmp_path, arch, conversational):
    """Standard and conversational prompt-only datasets; the MoE models with their router aux loss on."""
    model_init_kwargs = {"output_router_logits": True} if "moe" in arch or arch == "mixtral" else None
    args = short_args(tmp_path, model_init_kwargs=model_init_kwargs)
    trainer = SpyTrainer(
        str(paths[arch]), code_reward, args=args, train_dataset=prompts(conversational=conversational)
    )
    assert trainer.aux_loss_enabled == (model_init_kwargs is not None)
    _train(trainer)
    # generation and optimisation aligned: TRL runs no log-prob pass, POISE reads the loss's forward and adds none
    assert trainer.feature_passes == 0 and trainer._capture_route("train") == "loss"


def test_eval_datasets_dict_and_iterable(paths, tmp_path):
    """An iterable train dataset and a dict of eval datasets, one of them iterable: eval metrics per dataset."""
    args = short_args(tmp_path, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    eval_sets = {"plain": prompts(4), "stream": prompts(4).to_iterable_dataset()}
    trainer = SpyTrainer(
        str(paths["llama"]),
        code_reward,
        args=args,
        train_dataset=prompts().to_iterable_dataset(),
        eval_dataset=eval_sets,
    )
    _train(trainer)
    evals = [h for h in trainer.state.log_history if any(k.startswith("eval_") for k in h)]
    assert [next(k for k in h if k.endswith("_loss")) for h in evals] == ["eval_plain_loss", "eval_stream_loss"]
    assert all(math.isfinite(h["eval_poise/mae"]) for h in evals)


def test_eval_with_one_generation_keeps_the_baseline_column_in_step(paths, tmp_path):
    """num_generations_eval=1 has nothing to pair: the eval rows get a NaN baseline, never a training row's."""
    args = short_args(
        tmp_path, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=3, num_generations_eval=1
    )
    trainer = SpyTrainer(str(paths["qwen3"]), code_reward, args=args, train_dataset=prompts(), eval_dataset=prompts(3))
    trainer.train()
    baselines, logged_prompts = list(trainer._logs["extra"]["baseline"]), list(trainer._logs["prompt"])
    assert len(baselines) == len(logged_prompts) == len(trainer._logs["advantages"])
    assert all(math.isnan(b) for b in baselines[-3:])  # the 3 eval rows logged last
    assert baselines[:-3] and all(math.isfinite(b) for b in baselines[:-3])  # what the columns keep of training


def test_several_reward_functions_with_weights_and_none(paths, tmp_path):
    """Weighted rewards summed as TRL sums them, a function's None skipped; a row where every function returned None
    gets no advantage and no baseline, and is never a partner."""

    def scored_unless_0_or_1(completions, prompts, **kwargs):
        return [None if p[0] in "01" else r for p, r in zip(prompts, code_reward(completions), strict=True)]

    def one_unless_0_or_2(completions, prompts, **kwargs):
        return [None if p[0] in "02" else 1.0 for p in prompts]

    args = short_args(tmp_path, reward_weights=[2.0, 0.5])
    funcs = [scored_unless_0_or_1, one_unless_0_or_2]
    trainer = SpyTrainer(str(paths["qwen3"]), funcs, args=args, train_dataset=prompts(4))  # 2 steps see all 4
    _train(trainer)
    rows = [(p, step, i) for step in trainer.scored for i, p in enumerate(step["prompts"])]
    assert sorted({p[0] for p, _, _ in rows}) == ["0", "1", "2", "3"]
    for prompt, step, i in rows:
        completion = trainer.processing_class.decode(
            step["output"]["completion_ids"][i][step["output"]["completion_mask"][i].bool()],
            skip_special_tokens=True,
        )
        code = code_reward([completion])[0]
        expected = {"0": math.nan, "1": 0.5, "2": 2.0 * code}.get(prompt[0], 2.0 * code + 0.5)
        if prompt[0] == "0":
            assert math.isnan(step["rewards"][i]) and step["advantages"][i] == 0 and math.isnan(step["baselines"][i])
        else:
            assert step["rewards"][i].item() == pytest.approx(expected, abs=1e-6)


def test_reward_model_with_its_processing_class(paths, tmp_path):
    """A sequence-classification reward model with its own tokenizer next to a reward function."""
    reward_model = AutoModelForSequenceClassification.from_pretrained(paths["reward"])
    reward_tokenizer = AutoTokenizer.from_pretrained(paths["reward"])
    trainer = SpyTrainer(
        str(paths["qwen3_moe"]),
        [reward_model, code_reward],
        args=short_args(tmp_path),
        train_dataset=prompts(conversational=True),
        reward_processing_classes=[reward_tokenizer, None],
    )
    _train(trainer)
    assert any("rewards/reward/mean" in h for h in trainer.state.log_history)  # named after the model's folder


def test_kl_penalty_with_a_reference_model(paths, tmp_path):
    """beta > 0 reloads the reference model from the saved path; its pass is never captured. Three rollouts per
    prompt, as TRL's own tests use."""
    args = short_args(tmp_path, beta=0.1, num_generations=3, per_device_train_batch_size=3)
    trainer = SpyTrainer(str(paths["mixtral"]), code_reward, args=args, train_dataset=prompts())
    _train(trainer)
    assert trainer.ref_model is not None and any("kl" in h for h in trainer.state.log_history)


def test_multiple_iterations_reuse_trl_s_pass_and_poise_s_advantages(paths, tmp_path):
    """num_iterations=2: one generation serves two steps; POISE captures inside TRL's old-log-prob pass."""
    trainer = SpyTrainer(
        str(paths["llama"]),
        code_reward,
        args=short_args(tmp_path, num_iterations=2, max_steps=4),
        train_dataset=prompts(),
    )
    _train(trainer)
    assert trainer.feature_passes == 0 and len(trainer.scored) == 2 and len(trainer.loss_advantages) == 4


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_peft_lora(paths, tmp_path, arch):
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = SpyTrainer(
        str(paths[arch]), code_reward, args=short_args(tmp_path), train_dataset=prompts(), peft_config=peft_config
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    _train(trainer)
    for name, param in trainer.model.named_parameters():
        assert torch.equal(before[name], param) != ("lora" in name), name


def test_the_tiny_tokenizer_round_trips():
    """Precondition of the scenarios above: the character tokenizer is lossless on prompts and markup."""
    tokenizer = char_tokenizer()
    text = "12+3</think>\n\n7<tool_call>\n{}</tool_call>"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
