"""Feature extraction with plain tensors and the tiny model: spans, pooling, hooks, entropies."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from poise_trl.features.columns import DEFAULT_SCALARS, SCALARS, scalar_columns
from poise_trl.features.features import (
    FeatureLayout,
    capture_layer,
    feature_spans,
    find_decoder_layers,
    find_last_subsequence,
    pool_hidden,
    resolve_layer_index,
)
from poise_trl.tiny import build_tiny_tokenizer

MARKER = [7, 8]


def _batch(prompts: list[list[int]], completions: list[list[int]]):
    """Left-pad prompts and right-pad completions with 0, as TRL does."""
    p_len, c_len = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.tensor([[0] * (p_len - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (p_len - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [0] * (c_len - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (c_len - len(c)) for c in completions])
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def test_find_last_subsequence_takes_last_full_valid_occurrence():
    ids = torch.tensor([[7, 8, 1, 7, 8, 2], [1, 7, 1, 8, 2, 3], [7, 8, 0, 0, 0, 0], [1, 2, 3, 7, 8, 0]])
    mask = torch.tensor([[1] * 6, [1] * 6, [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    # Row 3: the marker's second token is padding, so it does not count.
    assert find_last_subsequence(ids, mask, MARKER).tolist() == [4, -1, 1, -1]
    assert find_last_subsequence(ids, mask, [9, 9, 9, 9, 9, 9, 9]).tolist() == [-1] * 4


def test_spans_cut_reasoning_at_last_marker_and_answer_after_it():
    prompts = [[11, 12, 13], [14, 15]]
    completions = [[20, 7, 8, 21, 7, 8, 22, 23], [30, 31, 32]]  # row 1 has no marker
    _, prompt_mask, completion_ids, completion_mask = _batch(prompts, completions)
    spans = feature_spans(prompt_mask, completion_ids, completion_mask, pool_tokens=2, marker_ids=MARKER)
    assert spans.reasoning_mask[0].tolist() == [True] * 6 + [False] * 2
    assert spans.answer_mask[0].tolist() == [False] * 6 + [True] * 2
    # No marker: the whole completion is reasoning, the answer span is the last n=2 tokens.
    assert spans.reasoning_mask[1].tolist() == [True] * 3 + [False] * 5
    assert spans.answer_mask[1].tolist() == [False, True, True] + [False] * 5
    # Pool positions are in concatenated coordinates (prompt length 3).
    assert spans.pool_index[0, 1].tolist() == [3 + 5, 3 + 4]
    assert spans.pool_index[1, 0].tolist() == [2, 1]
    no_marker = feature_spans(prompt_mask, completion_ids, completion_mask, pool_tokens=2, marker_ids=None)
    assert no_marker.reasoning_mask[0].tolist() == [True] * 8


def test_spans_use_only_generated_tokens_and_a_tool_marker_does_not_move_the_cut():
    """Multi-turn tool calls: tokens with generated_mask 0 (a tool result) are never pooled, never enter the entropy
    statistics or the length, and a marker inside them is not the policy's."""
    prompts = [[11, 12], [11, 12], [11, 12]]
    completions = [
        [20, 21, 7, 8, 40, 22, 23, 24],  # the tool result [7, 8, 40] holds the marker: no marker of the policy's
        [20, 7, 8, 30, 7, 8, 31],  # a tool result [7, 8], then the policy's own marker at 4-5
        [7, 8, 9],  # the policy wrote 7, the tool result starts with 8: no whole marker
    ]
    generated = [[1, 1, 0, 0, 0, 1, 1, 1], [1, 0, 0, 1, 1, 1, 1, 0], [1, 0, 1, 0, 0, 0, 0, 0]]
    _, prompt_mask, completion_ids, completion_mask = _batch(prompts, completions)
    spans = feature_spans(prompt_mask, completion_ids, completion_mask, 4, MARKER, torch.tensor(generated))
    on = lambda mask: [i for i, v in enumerate(mask.tolist()) if v]  # noqa: E731
    assert on(spans.completion_mask[0]) == on(spans.reasoning_mask[0]) == [0, 1, 5, 6, 7]
    # No marker of the policy's: the answer span is its last 4 tokens, and pooling skips the gap (prompt length 2).
    assert on(spans.answer_mask[0]) == [1, 5, 6, 7] and spans.pool_index[0, 1].tolist() == [2 + 7, 2 + 6, 2 + 5, 2 + 1]
    assert on(spans.reasoning_mask[1]) == [0, 3, 4, 5] and on(spans.answer_mask[1]) == [6]
    assert on(spans.reasoning_mask[2]) == [0, 2] and on(spans.answer_mask[2]) == [0, 2]
    entropies = torch.arange(8.0).repeat(3, 1)
    stats = scalar_columns(DEFAULT_SCALARS, entropies, spans)
    torch.testing.assert_close(stats[0], torch.tensor([19 / 5, 19 / 5, 19 / 4]))
    torch.testing.assert_close(stats[1], torch.tensor([18 / 5, 3.0, 6.0]))
    pooled = torch.zeros(3, 2, 1)
    assert FeatureLayout(("length",)).assemble(pooled, entropies, spans).flatten().tolist() == [5, 5, 2]


def test_pooling_matches_unpadded_per_row_recomputation():
    torch.manual_seed(0)
    prompts = [[1, 2, 3, 4, 5, 6], [1, 2], [3]]
    completions = [[9, 7, 8, 4], [5, 5, 5, 5, 5, 5, 5], [6]]
    _, prompt_mask, completion_ids, completion_mask = _batch(prompts, completions)
    n = 3
    spans = feature_spans(prompt_mask, completion_ids, completion_mask, n, MARKER)
    p_len = prompt_mask.size(1)
    hidden = torch.randn(3, p_len + completion_ids.size(1), 4)
    pooled = pool_hidden(hidden, spans.pool_index, spans.pool_weight)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        h_prompt = hidden[row, p_len - len(prompt) : p_len]
        h_completion = hidden[row, p_len : p_len + len(completion)]
        ends = [i + 1 for i in range(len(completion) - 1) if completion[i : i + 2] == MARKER]
        reasoning = h_completion[: ends[-1] + 1] if ends else h_completion
        torch.testing.assert_close(pooled[row, 0], h_prompt[-n:].mean(0))
        torch.testing.assert_close(pooled[row, 1], reasoning[-n:].mean(0))


def test_empty_completion_pools_to_zero_and_entropy_is_finite():
    prompt_mask = torch.ones(2, 3, dtype=torch.long)
    completion_ids = torch.tensor([[5, 6], [5, 6]])
    completion_mask = torch.tensor([[1, 1], [0, 0]])
    spans = feature_spans(prompt_mask, completion_ids, completion_mask, 4, MARKER)
    pooled = pool_hidden(torch.ones(2, 5, 3), spans.pool_index, spans.pool_weight)
    assert pooled[1, 1].abs().sum() == 0 and pooled[0, 1].eq(1).all()
    stats = scalar_columns(DEFAULT_SCALARS, torch.tensor([[1.0, 3.0], [float("nan"), 2.0]]), spans)
    assert torch.isfinite(stats).all()
    torch.testing.assert_close(stats[0], torch.tensor([2.0, 2.0, 2.0]))
    torch.testing.assert_close(stats[1], torch.zeros(3))


def test_entropy_statistics_by_hand():
    _, prompt_mask, completion_ids, completion_mask = _batch([[1]], [[3, 7, 8, 4, 5]])
    spans = feature_spans(prompt_mask, completion_ids, completion_mask, 10, MARKER)
    entropies = torch.tensor([[1.0, 2.0, 3.0, 10.0, 20.0]])
    torch.testing.assert_close(scalar_columns(DEFAULT_SCALARS, entropies, spans), torch.tensor([[7.2, 2.0, 15.0]]))


def test_the_layout_orders_the_blocks_and_holds_the_scalars_it_is_given():
    _, prompt_mask, completion_ids, completion_mask = _batch([[1, 2]], [[3, 4, 5]])
    spans = feature_spans(prompt_mask, completion_ids, completion_mask, 2, None)
    pooled = torch.arange(8.0).view(1, 2, 4)
    features = FeatureLayout(("length", "prompt", "entropy")).assemble(pooled, torch.ones(1, 3), spans)
    assert features.shape == (1, 4 + 3 + 1)
    assert features[0, :4].tolist() == [0, 1, 2, 3] and features[0, -1] == 3
    assert FeatureLayout().slices(4) == {"prompt": (0, 4), "reasoning": (4, 8), "entropy": (8, 11)}
    scalars = ("answer_tokens", "output_max_token_entropy")
    layout = FeatureLayout(("reasoning", "entropy", "length"), scalars)
    assert layout.slices(4) == {"reasoning": (0, 4), "entropy": (4, 6), "length": (6, 7)}
    assert layout.assemble(pooled, torch.tensor([[1.0, 5.0, 2.0]]), spans)[0, 4:].tolist() == [2, 5, 3]
    assert layout.read_scalars == scalars and FeatureLayout(("prompt",), scalars).read_scalars == ()


@pytest.mark.parametrize(("layer", "expected"), [(None, 19), (0, 0), (-1, 35), (35, 35), (-36, 0)])
def test_resolve_layer_index(layer, expected):
    assert resolve_layer_index(layer, 36) == expected


@pytest.mark.parametrize("layer", [36, -37, 100])
def test_resolve_layer_index_out_of_range_names_valid_range(layer):
    with pytest.raises(ValueError, match=r"\[-36, 35\]"):
        resolve_layer_index(layer, 36)


def test_find_decoder_layers_reports_attributes_tried():
    with pytest.raises(ValueError, match="get_decoder"):
        find_decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("use_peft", [False, True])
def test_hook_output_equals_output_hidden_states(tiny_model_path, use_peft):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    if use_peft:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    layers = find_decoder_layers(model)
    assert len(layers) == 4
    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch([[5, 6, 7, 8], [9, 10]], [[11, 3, 12], [13]])
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    spans = feature_spans(prompt_mask, completion_ids, completion_mask, 2, [3])
    # transformers applies the final norm to hidden_states[-1], so the last block's raw output is compared up to L-2.
    for index in range(3):
        with torch.no_grad(), capture_layer(layers[index], spans) as capture:
            out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        expected = pool_hidden(out.hidden_states[index + 1], spans.pool_index, spans.pool_weight)
        torch.testing.assert_close(capture.pooled(), expected)
        assert capture not in layers[index]._forward_hooks.values()


def test_hook_is_removed_when_the_pass_raises(tiny_model_path):
    layer = find_decoder_layers(AutoModelForCausalLM.from_pretrained(tiny_model_path))[1]
    hooks_before = len(layer._forward_hooks)
    _, prompt_mask, completion_ids, completion_mask = _batch([[1]], [[2]])
    spans = feature_spans(prompt_mask, completion_ids, completion_mask, 2, None)
    with pytest.raises(RuntimeError, match="boom"), capture_layer(layer, spans):
        assert len(layer._forward_hooks) == hooks_before + 1
        raise RuntimeError("boom")
    assert len(layer._forward_hooks) == hooks_before


def test_capture_refuses_a_pass_that_saw_the_wrong_rows():
    _, prompt_mask, completion_ids, completion_mask = _batch([[1], [2]], [[2], [3]])
    spans = feature_spans(prompt_mask, completion_ids, completion_mask, 2, None)
    layer = torch.nn.Identity()
    with capture_layer(layer, spans) as capture:
        layer(torch.zeros(1, 2, 3))
    with pytest.raises(RuntimeError, match="exactly one"):
        capture.pooled()


def test_nan_at_padding_never_reaches_the_pooled_mean_and_zero_width_completions_work():
    spans = feature_spans(torch.tensor([[0, 0, 1]]), torch.tensor([[5, 6]]), torch.tensor([[1, 1]]), 2, None)
    hidden = torch.zeros(1, 5, 4)
    hidden[0, 1] = float("nan")  # a padding position that an unfilled prompt slot points at
    assert torch.isfinite(pool_hidden(hidden, spans.pool_index, spans.pool_weight)).all()
    empty = feature_spans(
        torch.ones(2, 3, dtype=torch.long),
        torch.zeros(2, 0, dtype=torch.long),
        torch.zeros(2, 0, dtype=torch.long),
        2,
        MARKER,
        tokenizer=build_tiny_tokenizer(),
    )
    pooled = pool_hidden(torch.randn(2, 3, 4), empty.pool_index, empty.pool_weight)
    assert pooled[:, 1].eq(0).all()
    assert torch.equal(scalar_columns(list(SCALARS), torch.zeros(2, 0), empty), torch.zeros(2, len(SCALARS)))


def test_pca_blocks_cap_a_preset_at_the_block_width_and_refuse_explicit_dims_beyond_it():
    assert FeatureLayout().pca_blocks(8, [32, 64], cap_at_width=True) == [(0, 8, 8), (8, 16, 8)]
    assert FeatureLayout(("reasoning",)).pca_blocks(8, [32, 4], cap_at_width=True) == [(0, 8, 4)]
    with pytest.raises(ValueError, match="asks for 32 components of the prompt block, which has only 8 columns"):
        FeatureLayout(("prompt", "reasoning")).pca_blocks(8, [32, 0])
