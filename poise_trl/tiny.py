"""Tiny offline models: a character tokenizer and a causal LM of a real architecture at toy scale, built locally
(no hub).

They live in the library because two packages that may not import each other build on them: the library's tests
train them (`tests/`, run with the lab unimportable) and the lab warm-starts the tiny Qwen3 as its toy model
(`poise_lab.models.toy`). `build_tiny_tokenizer`, `build_tiny_model` and `save_tiny` are that tiny Qwen3;
`char_tokenizer`, `tiny_config` and `causal_lm` are what it is built from, and what the tests build their other
architectures and vocabularies from.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>", "</think>")  # the tiny Qwen3's fixed ids 0-3
DEFAULT_ALPHABET = "0123456789+-*=?:;,.()[]<>/ abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"
# Renders a conversation as plain text, so conversational and standard datasets both work.
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% if not loop.last %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)
# (config class, model class, the architecture's own settings): dense, or mixture-of-experts with 4 experts, top-2.
ARCHS: dict[str, tuple[type, type, dict[str, int]]] = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(num_experts=4, num_experts_per_tok=2)),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
}


def char_tokenizer(
    alphabet: str,
    leading: Sequence[str],
    words: Sequence[str],
    chat_template: str = PLAIN_TEMPLATE,
) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet` (newlines too), after the `leading` tokens (pad, EOS and unknown first,
    ids 0-2), and each of `words` as one token (e.g. `</think>`).

    The words are added as tokens that are not special, as in Qwen3: TRL decodes with `skip_special_tokens=True`,
    and rewards and parsers must see them.
    """
    vocab = {token: i for i, token in enumerate(leading)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=leading[2]))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=leading[0], eos_token=leading[1], unk_token=leading[2], padding_side="left"
    )
    tokenizer.add_tokens([AddedToken(word, special=False) for word in words])
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_config(
    arch: str, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, **settings: Any
) -> PretrainedConfig:
    """`arch`'s config at toy scale: intermediate size twice the hidden size, head size hidden / heads, pad id 0;
    `settings` are the config's other fields."""
    config_class, _, arch_settings = ARCHS[arch]
    if arch == "qwen3_moe":
        arch_settings = dict(arch_settings, moe_intermediate_size=hidden_size)
    return config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        pad_token_id=0,
        **arch_settings,
        **settings,
    )


def causal_lm(
    arch: str,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_positions: int,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> PreTrainedModel:
    """A causal LM of `arch` (a key of `ARCHS`) from `tiny_config`, initialised from `seed`, that generates with
    pad id 0 and EOS id 1 (`char_tokenizer`'s layout)."""
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: choose one of {tuple(ARCHS)}.")
    torch.manual_seed(seed)
    config = tiny_config(
        arch,
        vocab_size,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=1,
        bos_token_id=None,
    )
    model = ARCHS[arch][1](config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    return model


def build_tiny_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """The tiny Qwen3's tokenizer: one token per character, plus `</think>` as a single token, as real reasoning
    models have it."""
    return char_tokenizer(alphabet, SPECIAL_TOKENS, words=("</think>",))


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast, num_layers: int = 4, hidden_size: int = 128, seed: int = 0
) -> PreTrainedModel:
    """A 4-layer Qwen3 with hidden size 128 (about 1M parameters): the real architecture, at toy scale."""
    return causal_lm(
        "qwen3",
        len(tokenizer),
        hidden_size,
        num_layers,
        num_heads=4,
        num_kv_heads=2,
        max_positions=512,
        tie_word_embeddings=True,
        seed=seed,
    )


def save_tiny(path: str | Path, num_layers: int = 4, hidden_size: int = 128, seed: int = 0) -> Path:
    """Build and `save_pretrained` the tiny model and its tokenizer at `path`, so trainers can load it by name."""
    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(tokenizer, num_layers=num_layers, hidden_size=hidden_size, seed=seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
