"""capture_pass: one pass hooked for every candidate layer (and a token capture), equal to hooking each alone, and
no hook left behind, even when the pass fails."""

import pytest
import torch

from poise_trl.features.capture import capture_pass
from poise_trl.features.features import FeatureLayout, capture_layer, feature_spans, find_decoder_layers
from poise_trl.features.prefix import PrefixCapture, prefix_spans
from poise_trl.tiny import build_tiny_model, build_tiny_tokenizer

LAYOUT = FeatureLayout()


@pytest.fixture(scope="module")
def tiny():
    model = build_tiny_model(build_tiny_tokenizer(), num_layers=3, hidden_size=32, seed=0).eval()
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    completion_ids = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]])
    completion_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    ids = torch.cat([torch.tensor([[0, 3, 4, 5], [6, 7, 8, 9]]), completion_ids], 1)
    return model, find_decoder_layers(model), ids, prompt_mask, completion_ids, completion_mask


def _entropies(model, ids, mask, width):
    logits = model(ids, attention_mask=mask).logits[:, -width - 1 : -1]
    return -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)


def test_one_pass_equals_a_pass_per_layer_and_the_token_capture_reads_the_first(tiny):
    model, layers, ids, prompt_mask, completion_ids, completion_mask = tiny
    mask = torch.cat([prompt_mask, completion_mask], 1)
    spans = feature_spans(prompt_mask, completion_ids, completion_mask, 2, None)
    token_spans = prefix_spans(prompt_mask, completion_mask, 2, 2, None, torch.Generator().manual_seed(0))
    with torch.no_grad(), capture_pass([layers[2], layers[0]], spans, LAYOUT, PrefixCapture(token_spans, None)) as c:
        entropies = _entropies(model, ids, mask, 4)
    features, tokens = c.result(entropies)
    assert features.shape == (2, 2, 2 * 32 + 3)
    for slot, index in enumerate((2, 0)):
        with torch.no_grad(), capture_layer(layers[index], spans) as alone:
            _entropies(model, ids, mask, 4)
        torch.testing.assert_close(features[:, slot], LAYOUT.assemble(alone.pooled(), entropies, spans))
    with torch.no_grad(), capture_layer(layers[2], PrefixCapture(token_spans, None)) as alone:
        _entropies(model, ids, mask, 4)
    torch.testing.assert_close(tokens.rows, alone.batch(entropies).rows)
    with torch.no_grad(), capture_pass([layers[1]], spans, LAYOUT) as sequence_only:
        _entropies(model, ids, mask, 4)
    assert sequence_only.result(entropies)[1] is None


def test_no_hook_outlives_the_block_even_when_the_pass_fails(tiny):
    model, layers, ids, prompt_mask, completion_ids, completion_mask = tiny
    spans = feature_spans(prompt_mask, completion_ids, completion_mask, 2, None)
    token_spans = prefix_spans(prompt_mask, completion_mask, 2, 2, None, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="boom"):
        with capture_pass(list(layers), spans, LAYOUT, PrefixCapture(token_spans, None)):
            assert sum(len(layer._forward_hooks) for layer in layers) == len(layers) + 1
            raise RuntimeError("boom")
    assert all(not layer._forward_hooks for layer in layers)
