"""Every GRPOTrainer training option composes with POISE: each loss type, GSPO's sequence-level ratio, the
off-policy mask, the entropy-quantile mask, several optimisation steps per generation, batch reward scaling, and the
`GRPOConfig` options of the sampling, loss, reference-model, model and logging groups (docs/support-matrix.md names
each option's test). Each run trains 2+ steps and checks that POISE's advantages are what TRL's loss received."""

import pytest
import torch
from trl import GRPOConfig

from ..conftest import short_args
from ..tiny_archs import SpyTrainer, assert_poise_advantages_reach_the_loss, code_reward, prompts, save_causal_lm

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_causal_lm(tmp_path_factory.mktemp("options") / "qwen3", "qwen3")


def _train(model_path, tmp_path, conversational: bool = False, **overrides) -> SpyTrainer:
    args = short_args(tmp_path, **overrides)
    trainer = SpyTrainer(str(model_path), code_reward, args=args, train_dataset=prompts(conversational=conversational))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert_poise_advantages_reach_the_loss(trainer)
    return trainer


def test_every_loss_type_of_trl_is_covered():
    """The list below is TRL's: a loss type added in a later release must be added here (and checked)."""
    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    listed = [t for t in LOSS_TYPES if f"'{t}'" in help_text]
    assert listed == list(LOSS_TYPES)
    assert help_text.count("', '") + help_text.count("', and '") == len(LOSS_TYPES) - 1


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_types(model_path, tmp_path, loss_type):
    # LUSPO is GSPO's length-unbiased variant and is meant for sequence-level ratios.
    level = "sequence" if loss_type == "luspo" else "token"
    _train(model_path, tmp_path, loss_type=loss_type, importance_sampling_level=level)


@pytest.mark.parametrize(
    "option",
    [
        dict(importance_sampling_level="sequence", loss_type="grpo"),  # GSPO
        dict(off_policy_mask_threshold=0.5, num_iterations=2, max_steps=4),  # drops off-policy negative sequences
        dict(top_entropy_quantile=0.5),  # loss on the top half of tokens by entropy
        dict(steps_per_generation=2, max_steps=4),  # one generation split over 2 optimiser steps
    ],
    ids=["gspo", "off_policy_mask", "top_entropy_quantile", "steps_per_generation"],
)
def test_training_options(model_path, tmp_path, option):
    trainer = _train(model_path, tmp_path, **option)
    # With several optimiser steps per generation TRL runs its old-log-prob pass, and POISE captures inside it;
    # otherwise POISE reads the loss's own forward. Either way it runs no pass of its own.
    reused = option.get("num_iterations", 1) * option.get("steps_per_generation", 1) > 1
    assert trainer._capture_route("train") == ("trl_pass" if reused else "loss")
    assert trainer.feature_passes == 0


# GRPOConfig options that do not interact, trained together in one run per group.
OPTION_GROUPS = {
    "sampling": dict(
        temperature=0.9,
        top_p=0.95,
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.1,
        generation_kwargs={"no_repeat_ngram_size": 3},
    ),
    "clipping_and_entropy_bonus": dict(delta=1.5, epsilon=0.1, epsilon_high=0.3, entropy_coef=0.01),
    "adaptive_entropy": dict(
        use_adaptive_entropy=True,
        entropy_coef=0.01,
        entropy_coef_min=0.0,
        entropy_coef_max=0.05,
        entropy_coef_delta=0.01,
        entropy_target=0.5,
        max_steps=3,
    ),
    "reference_model_sync": dict(
        beta=0.04, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5, use_bias_correction_kl=False
    ),
    "model_and_batching": dict(
        disable_dropout=True, cast_lm_head_to_fp32=True, pad_to_multiple_of=8, shuffle_dataset=False
    ),
    "logging": dict(log_completions=True, num_completions_to_print=2, log_unique_prompts=True),
    "continuous_batching": dict(  # transformers' generation engine, not vLLM; a small cache keeps it fast on a CPU
        use_transformers_continuous_batching=True,
        transformers_continuous_batching_config={"page_size": 16, "num_blocks": 16, "max_batch_tokens": 64},
    ),
    "chat_template": dict(chat_template_kwargs={"enable_thinking": False}),  # on a conversational dataset
}


@pytest.mark.parametrize("group", list(OPTION_GROUPS))
def test_grpo_config_option_groups(model_path, tmp_path, group):
    trainer = _train(model_path, tmp_path, conversational=group == "chat_template", **OPTION_GROUPS[group])
    for name, value in OPTION_GROUPS[group].items():
        assert getattr(trainer.args, name) == value, name  # the option reached the trainer as set
    if group == "reference_model_sync":
        assert any(type(c).__name__ == "SyncRefModelCallback" for c in trainer.callback_handler.callbacks)


def test_batch_scaling_divides_by_the_std_of_earlier_steps_rewards(model_path, tmp_path):
    """scale_rewards="batch": the first step is unscaled; each later step divides by the sample std of every earlier
    step's rewards (+1e-4), never by a std that contains the step's own rewards."""
    trainer = _train(model_path, tmp_path, scale_rewards="batch", max_steps=3)
    divisors = [float(s["divisor"]) for s in trainer.scored]
    rewards = [s["rewards"] for s in trainer.scored]
    assert divisors[0] == 1.0
    for step in (1, 2):
        earlier = torch.cat(rewards[:step]).double()
        assert divisors[step] == pytest.approx(earlier.std().item() + 1e-4, rel=1e-12)
    assert trainer.estimator.reward_std_.count == sum(r.numel() for r in rewards)
