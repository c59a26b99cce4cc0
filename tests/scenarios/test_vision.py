"""Vision-language models: POISE's own feature pass takes the multimodal inputs TRL's log-prob pass takes.

A tiny LLaVA (CLIP vision tower, Qwen3 text model, hidden size 16) with a processor built locally. Qwen2-VL-style
processors need torchvision for their video processor, which the CPU test environment does not install; LLaVA's
CLIP image processor runs on PIL alone."""

from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from PIL import Image
from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

from poise_trl import POISEConfig
from poise_trl.grpo.routes import FORWARD_INPUT_KEYS
from poise_trl.grpo.step import GenerationStep

from ..conftest import short_args
from ..tiny_archs import SpyTrainer, assert_poise_advantages_reach_the_loss, char_tokenizer, code_reward

# Renders an image part as LLaVA's `<image>` placeholder, which the processor expands to one token per patch.
TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if not loop.last %}\n{% endif %}{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory) -> Path:
    tokenizer = char_tokenizer(TEMPLATE, extra_tokens=("<image>",))
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=TEMPLATE,
    )
    config = LlavaConfig(
        text_config=dict(
            model_type="qwen3",
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            pad_token_id=0,
            eos_token_id=1,
        ),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    path = tmp_path_factory.mktemp("vlm") / "llava"
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def _image_prompts(n: int = 4) -> Dataset:
    rng = np.random.default_rng(0)
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"q{i}"}]}],
                "image": Image.fromarray(rng.integers(0, 255, (28, 28, 3), dtype=np.uint8)),
            }
            for i in range(n)
        ]
    )


def _args(tmp_path, **overrides) -> POISEConfig:
    """The paper's probe input (φ without the reward column), which the recorded features are compared with."""
    return short_args(tmp_path, probe_preset="paper", probe_partner_reward=False, **overrides)


class BothPasses(SpyTrainer):
    """With several optimiser steps per generation POISE captures inside TRL's old-log-prob pass; on the same batch
    this also runs POISE's own feature pass, with and without the multimodal inputs, to compare the three."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.own_pass = self._own_pass_features(output)
        self.text_only_pass = self._own_pass_features({k: v for k, v in output.items() if k not in FORWARD_INPUT_KEYS})
        return output

    def _own_pass_features(self, output: dict) -> torch.Tensor:
        """POISE's own no-grad pass over `output`, as the "own_pass" route runs it, captured in a record of its own."""
        step = self._generation = GenerationStep("train", "own_pass", rows=output["completion_ids"].size(0))
        self._feature_pass(output, "train")
        self._generation = None
        return step.assemble()[0]


def test_poise_s_own_pass_sees_the_images_trl_s_pass_sees(vlm_path, tmp_path):
    trainer = BothPasses(
        str(vlm_path), code_reward, args=_args(tmp_path, steps_per_generation=2), train_dataset=_image_prompts()
    )
    assert trainer._is_vlm
    trainer.train()
    assert trainer.feature_passes == 2  # the two made here; the step itself reused TRL's pass
    assert "pixel_values" in trainer.scored[0]["output"]
    trl_pass = trainer.scored[0]["features"]
    torch.testing.assert_close(trainer.own_pass, trl_pass, atol=1e-5, rtol=1e-5)
    prompt_block = slice(0, 16)  # the image tokens sit in the prompt: without them its pooled states change
    assert not torch.allclose(trainer.text_only_pass[..., prompt_block], trl_pass[..., prompt_block], atol=1e-3)
    assert_poise_advantages_reach_the_loss(trainer)


@pytest.mark.parametrize("capture", ["auto", "pass"])
def test_training_a_vlm_without_trls_pass(vlm_path, tmp_path, capture):
    """Generation and optimisation aligned: no TRL pass to reuse; POISE reads the loss's forward, images included
    ("auto"), or runs its own pass with them ("pass")."""
    args = _args(tmp_path, probe_capture=capture)
    trainer = SpyTrainer(str(vlm_path), code_reward, args=args, train_dataset=_image_prompts())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.feature_passes == (0 if capture == "auto" else 2)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert_poise_advantages_reach_the_loss(trainer)
