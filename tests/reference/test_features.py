"""The features against the POISE authors' reference (verl-recipe, `poise/features.py`): its entropy statistics are
the rollout scalars `REFERENCE_SCALARS` (spans cut from the decoded text, through the tokenizer the spans carry), its
pooled states are the library's own pooling, on its outputs for fixed cases (tests/fixtures/reference/features.json);
and its own feature tests (its `tests/test_features.py`), restated through this library's API."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from poise_trl import POISETrainer
from poise_trl.features.columns import REFERENCE_SCALARS, SCALARS, scalar_columns
from poise_trl.features.features import FeatureSpans, PooledCapture, capture_layer, feature_spans
from poise_trl.features.text_spans import text_spans
from poise_trl.tiny import build_tiny_tokenizer

from ..conftest import digit_dataset, digit_reward, poise_args

CASES = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "reference" / "features.json").read_text())
TOKENIZER = build_tiny_tokenizer()  # the cases' tokenizer: `</think>` one token, EOS special
MARKER_IDS = TOKENIZER("</think>", add_special_tokens=False)["input_ids"]  # as POISETrainer finds the marker


def _right_padded(rows: list[list[float]], fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    values = torch.tensor([row + [fill] * (width - len(row)) for row in rows])
    return values, torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])


def _entropy_spans(cases: list[dict], **settings) -> tuple[torch.Tensor, FeatureSpans]:
    """The cases as one right-padded batch (padding: token 0 and entropy NaN, never read) and its spans."""
    ids, mask = _right_padded([case["response_ids"] for case in cases])
    entropies, _ = _right_padded([case["entropies"] for case in cases], fill=float("nan"))
    spans = feature_spans(torch.ones(len(cases), 1), ids.long(), mask, 4, MARKER_IDS, tokenizer=TOKENIZER, **settings)
    return entropies, spans


@pytest.mark.parametrize("case", CASES["entropy_cases"], ids=lambda case: case["name"])
def test_each_entropy_case_gives_the_reference_statistics(case):
    """[output mean, reasoning mean, answer mean]: spans from the decoded text, the counts fallback where decoding
    drops a special EOS."""
    entropies, spans = _entropy_spans([case])
    expected = torch.tensor([case["reference_entropy_stats"]], dtype=torch.float32)
    assert torch.equal(scalar_columns(REFERENCE_SCALARS, entropies, spans), expected)


def test_the_entropy_cases_in_one_padded_batch_and_rows_in_any_order_give_the_reference_statistics():
    entropies, spans = _entropy_spans(CASES["entropy_cases"])
    expected = torch.tensor([case["reference_entropy_stats"] for case in CASES["entropy_cases"]])
    assert torch.equal(scalar_columns(REFERENCE_SCALARS, entropies, spans), expected)
    order = torch.tensor([5, 0, 7, 2, 1, 6, 3, 4])
    assert torch.equal(scalar_columns(REFERENCE_SCALARS, entropies[order], spans.rows(order)), expected[order])


def test_a_token_the_policy_did_not_write_is_left_out_of_the_decoded_text():
    """A tool result inside a completion (TRL's tool mask): the reference's response mask leaves it out, so do the
    text spans; the statistics are those of the completion without it."""
    case = next(case for case in CASES["entropy_cases"] if case["name"] == "think_then_answer_no_eos")
    at, tool = 9, TOKENIZER.convert_tokens_to_ids("z")
    ids = case["response_ids"][:at] + [tool] + case["response_ids"][at:]
    entropies = case["entropies"][:at] + [100.0] + case["entropies"][at:]
    generated = torch.ones(1, len(ids), dtype=torch.long)
    generated[0, at] = 0
    spans = feature_spans(
        torch.ones(1, 1), torch.tensor([ids]), torch.ones(1, len(ids)), 4, MARKER_IDS, generated, TOKENIZER
    )
    columns = scalar_columns(REFERENCE_SCALARS, torch.tensor([entropies]), spans)
    assert columns.tolist() == [case["reference_entropy_stats"]]


def test_a_scalar_cut_from_the_text_without_a_tokenizer_says_how_to_give_it():
    entropies, spans = _entropy_spans(CASES["entropy_cases"][:2])
    bare = feature_spans(torch.ones(2, 1), spans.completion_ids, spans.completion_mask, 4, MARKER_IDS)
    assert bare.tokenizer is None and all(SCALARS[name].reads_text for name in REFERENCE_SCALARS[1:])
    with pytest.raises(ValueError, match=r"'text_reasoning_mean_token_entropy' .*feature_spans\(\.\.\., tokenizer="):
        scalar_columns(REFERENCE_SCALARS, entropies, bare)
    assert scalar_columns(REFERENCE_SCALARS[:1], entropies, bare).shape == (2, 1)  # the output mean reads no text


class PositionLayer(nn.Module):
    """A decoder layer whose output is the (b, L, 1) hidden states it is given."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def _pool(
    prompts: list[list[int]],
    completions: list[list[int]],
    positions: list[list[float]],
    pool_tokens: int,
    marker_ids: list[int],
    generated: list[list[int]] | None = None,
) -> torch.Tensor:
    """(B, 2) pooled [prompt, reasoning] states through the library's spans and pooling capture, in TRL's layout
    (prompts left-padded, completions right-padded): each row's hidden state is `positions[row]` (its prompt then
    its completion), NaN on padding."""
    p_width, c_width = max(map(len, prompts)), max(map(len, completions))
    prompt_mask = torch.tensor([[0] * (p_width - len(p)) + [1] * len(p) for p in prompts])
    completion_ids, completion_mask = _right_padded([list(map(float, c)) for c in completions])
    hidden = torch.full((len(prompts), p_width + c_width, 1), float("nan"))
    for row, (prompt, values) in enumerate(zip(prompts, positions, strict=True)):
        start = p_width - len(prompt)
        hidden[row, start : start + len(values), 0] = torch.tensor(values)
    generated = None if generated is None else _right_padded([list(map(float, g)) for g in generated])[0]
    spans = feature_spans(prompt_mask, completion_ids.long(), completion_mask, pool_tokens, marker_ids, generated)
    layer = PositionLayer()
    with capture_layer(layer, spans) as capture:
        layer(hidden)
    return capture.pooled()[..., 0]


def test_each_pool_case_gives_the_reference_pooled_states():
    """Hidden states equal to the position index, 4 pooled tokens, `</think>` the marker: the mean of the last 4
    prompt positions, and of the last 4 completion positions up to and including the last marker (the last 4 of the
    completion without one)."""
    cases = CASES["pool_cases"]
    prompts = [case["input_ids"][: len(case["input_ids"]) - len(case["response_ids"])] for case in cases]
    positions = [list(map(float, range(len(case["input_ids"])))) for case in cases]
    pooled = _pool(prompts, [case["response_ids"] for case in cases], positions, 4, MARKER_IDS)
    expected = [[case["reference_prompt_pool"], case["reference_response_pool"]] for case in cases]
    assert {case["pool_tokens"] for case in cases} == {4} and pooled.tolist() == expected


# ------------------------------------------------------------------ the reference's own tests/test_features.py
def test_pooling_includes_the_marker_and_skips_tokens_the_policy_did_not_write():
    """Its `test_pooling_includes_think_end_and_excludes_masked_tokens` (unpacked: this library never packs rows):
    the masked token is one the policy did not write (the tool mask)."""
    pooled = _pool(
        [[10, 11], [10]],
        [[1, 2, 3, 99], [4, 5]],
        [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0]],
        pool_tokens=2,
        marker_ids=[2],
        generated=[[1, 1, 1, 0], [1, 1]],
    )
    assert pooled.tolist() == [[0.5, 2.5], [6.0, 7.5]]


def test_an_empty_completion_pools_to_zero_and_the_last_multi_token_marker_ends_the_reasoning():
    """Its `test_empty_response_and_last_multitoken_marker`: the second completion's only token is masked."""
    pooled = _pool(
        [[0], [0]],
        [[1, 2, 1, 2, 3], [1]],
        [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0]],
        pool_tokens=2,
        marker_ids=[1, 2],
        generated=[[1, 1, 1, 1, 1], [0]],
    )
    assert pooled[:, 1].tolist() == [3.5, 0.0]


def test_the_hook_is_removed_when_the_forward_fails():
    """Its `test_hook_cleanup_on_forward_failure`."""
    layer = PositionLayer()
    spans = feature_spans(torch.ones(1, 1), torch.tensor([[1]]), torch.ones(1, 1), 1, None)
    with pytest.raises(RuntimeError, match="forward failed"), capture_layer(layer, spans) as capture:
        assert isinstance(capture, PooledCapture) and layer._forward_hooks
        raise RuntimeError("forward failed")
    assert not layer._forward_hooks


class CharTokenizer:
    """One token per character, its code point; offsets are the character's own."""

    def decode(self, ids: list[int], **kwargs) -> str:
        return "".join(chr(i) for i in ids)

    def encode(self, text: str, **kwargs) -> list[int]:
        return [ord(ch) for ch in text]

    def __call__(self, text: str, **kwargs) -> dict[str, list]:
        return {"input_ids": self.encode(text), "offset_mapping": [(i, i + 1) for i in range(len(text))]}


def test_the_text_spans_with_a_character_tokenizer():
    """Its `test_entropy_spans_and_untagged_response`: the reasoning inside the tags, the answer after `</think>`
    without its leading space; an untagged completion has neither."""
    tokenizer, text = CharTokenizer(), "<think>abc</think> xy"
    entropies = torch.arange(len(text), dtype=torch.float32)

    def spans(text: str) -> FeatureSpans:
        ids = torch.tensor([tokenizer.encode(text)])
        return feature_spans(torch.ones(1, 1), ids, torch.ones_like(ids), 4, None, tokenizer=tokenizer)

    expected = [entropies.mean(), entropies[7:10].mean(), entropies[-2:].mean()]
    assert scalar_columns(REFERENCE_SCALARS, entropies[None], spans(text))[0].tolist() == [x.item() for x in expected]
    assert scalar_columns(REFERENCE_SCALARS, torch.tensor([[1.0, 2.0, 3.0]]), spans("abc")).tolist() == [[2, 0, 0]]


def test_a_training_step_computes_the_reference_scalars_with_the_trainers_tokenizer(
    tiny_model_path, tmp_path, monkeypatch
):
    """POISETrainer hands its processing class to the spans: every batch's `text_*` columns are the reference's
    statistics of each completion's generated tokens, decoded by the model's own tokenizer (the untrained tiny
    model writes no tags, so they are 0 here: what this checks is that the tokenizer arrives)."""
    import poise_trl.features.features as features

    calls = []

    def recorded(names, entropies, spans):
        columns = scalar_columns(names, entropies, spans)
        calls.append((tuple(names), entropies, spans, columns))
        return columns

    monkeypatch.setattr(features, "scalar_columns", recorded)
    args = poise_args(tmp_path, max_steps=1, probe_scalars=list(REFERENCE_SCALARS))
    trainer = POISETrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    trainer.train()
    seen = [call for call in calls if call[0] == REFERENCE_SCALARS]
    assert seen and all(spans.tokenizer is trainer.processing_class for _, _, spans, _ in seen)
    for _, entropies, spans, columns in seen:
        for row in range(columns.size(0)):
            kept = spans.completion_mask[row].nonzero().flatten().tolist()
            reasoning, answer = text_spans(TOKENIZER, spans.completion_ids[row, kept].tolist())
            values = entropies[row, kept].float()
            means = [values[i].mean().item() if i else 0.0 for i in (reasoning, answer)]
            torch.testing.assert_close(columns[row, 1:], torch.tensor(means), atol=1e-6, rtol=1e-6)
