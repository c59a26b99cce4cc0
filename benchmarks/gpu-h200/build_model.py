"""A random Qwen3 of a real shape (28 layers, d=1024, 16 heads / 8 KV, head_dim 128, intermediate 3072: ~0.44B with
the character tokenizer), saved for the GPU checks. `small` builds a 2-layer twin for a CPU dry run."""
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from poise_trl.tiny import build_tiny_tokenizer

path, size = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "real"
tok = build_tiny_tokenizer()
torch.manual_seed(0)
shape = dict(num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128)
if size == "small":
    shape = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
config = Qwen3Config(vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=True,
                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None, **shape)
model = Qwen3ForCausalLM(config)
model.generation_config.pad_token_id = tok.pad_token_id
model.generation_config.eos_token_id = tok.eos_token_id
model.save_pretrained(path)
tok.save_pretrained(path)
print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters at {path}")
