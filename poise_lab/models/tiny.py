"""Tiny offline models: a character-level tokenizer and a ~1M-parameter Qwen3, built locally (no hub)."""

from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>", "</think>"]  # fixed ids 0-3
DEFAULT_ALPHABET = "0123456789+-*=?:;,.()[]<>/ abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"
# The chat template renders a conversation as plain text, so conversational and standard datasets both work.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% if not loop.last %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)


def build_tiny_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """One token per character, plus `</think>` as a single token, as real reasoning models have it."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in dict.fromkeys(alphabet):
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )
    # Not special, as in Qwen3: TRL decodes completions with skip_special_tokens=True, and rewards must see it.
    tokenizer.add_tokens([AddedToken("</think>", special=False)])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast, num_layers: int = 4, hidden_size: int = 128, seed: int = 0
) -> Qwen3ForCausalLM:
    """A 4-layer Qwen3 with hidden size 128 (about 1M parameters): the real architecture, at toy scale."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_tiny(path: str | Path, num_layers: int = 4, hidden_size: int = 128, seed: int = 0) -> Path:
    """Build and `save_pretrained` a tiny model and tokenizer at `path`, so trainers can load it by name."""
    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(tokenizer, num_layers=num_layers, hidden_size=hidden_size, seed=seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
