"""The rollout scalars: one-column features of a rollout, computed from what its teacher-forced pass already holds
(the per-token entropies, the spans of `features.feature_spans`, the completion's token ids), in a name -> scalar
table. A new scalar is one entry of `SCALARS`: its name, what it says (help text), and its computation. Scalars sit
after the pooled hidden states in the feature row and never in a PCA block (the official code appends them unprojected
too); `POISEConfig.probe_scalars` lists the ones the probe reads, in order.

The names and meanings are the official code's (holi-lab/POISE: src/poise/trainer.py,
`RayPOISETrainer._rollout_entropy_features` and `_entropy_stats`, the 12 token-entropy statistics;
src/poise/estimator.py, `SingleTrajectoryFeatureBuilder.build_inputs`, the length and repetition features and the gaps
between them), computed on this library's spans, which are the paper's: "output" is every token the policy generated,
"reasoning" runs from the first one to the last reasoning-end marker (marker included; the whole completion without
one), "answer" is what follows the marker (the last n generated tokens without one). The official code cuts its spans
from the decoded text by regular expressions (the text inside `<think>...</think>`, empty without it; the answer inside
`<answer>` tags or after `</think>`, empty without them) and counts a span's words after splitting its text on
whitespace; from token ids alone, a span's tokens stand for its words here (`*_unique_token_ratio`,
`*_repetition_ratio`). Where a span is empty a statistic is 0, as there (its `_entropy_stats` gives 0.0, and
`build_inputs` reads a missing ratio as 0.0). The official code's line-level (`duplicate_line_ratio`) and
text-presence features (`has_complete_answer`, `has_reasoning_content`) need the decoded text and are not offered.

The `text_*` scalars are the POISE authors' reference's (verl-project/verl-recipe, `poise/features.py`,
`entropy_features`): its mean token entropy over the reasoning and the answer span cut from the decoded text
(text_spans.py), which need the tokenizer the spans carry (`features.feature_spans(..., tokenizer=...)`; the trainer
passes its own). The reference's third statistic, the mean over the whole output, is `output_mean_token_entropy`:
`REFERENCE_SCALARS` are the three.

This module imports no torch (its computations call tensor methods only), so the command lines list the scalars
without loading it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import Tensor


class Spans(Protocol):
    """What the scalars read of a batch's spans (`features.FeatureSpans` is one): (B, C) masks of the generated, the
    reasoning and the answer tokens, and the completion's token ids; for the `text_*` scalars the tokenizer (None
    where not known) and the reasoning and answer masks cut from the decoded text."""

    completion_mask: Tensor
    reasoning_mask: Tensor
    answer_mask: Tensor
    completion_ids: Tensor
    tokenizer: Any

    @property
    def text_masks(self) -> tuple[Tensor, Tensor]: ...


SPANS = {"output": "completion_mask", "reasoning": "reasoning_mask", "answer": "answer_mask"}
"""A scalar's span name -> the `Spans` mask of its tokens."""

DEFAULT_SCALARS = ("output_mean_token_entropy", "reasoning_mean_token_entropy", "answer_mean_token_entropy")
"""The paper's three entropy statistics (§3), the official code's `scalar_keys` for Qwen3-4B and OLMo-3-7B."""

REFERENCE_SCALARS = (
    "output_mean_token_entropy",
    "text_reasoning_mean_token_entropy",
    "text_answer_mean_token_entropy",
)
"""The POISE authors' reference's three entropy statistics (`entropy_features`): its spans from the decoded text."""


@dataclass(frozen=True)
class Scalar:
    """One rollout scalar: what it is (the help text lists it) and its (B,) float32 column from the (B, T) per-token
    entropies (finite: NaN and infinities read as 0) and the batch's spans."""

    help: str
    compute: Callable[[Tensor, Spans], Tensor]
    reads_text: bool = False  # cuts its span from the decoded text: needs the spans' tokenizer


def _mask(spans: Spans, span: str) -> Tensor:
    return getattr(spans, SPANS[span]).bool()


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Per row, the mean of `values` (B, T) over `mask`; 0 for a row with no masked entry."""
    weights = mask.to(values.dtype)
    return (values * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def _last(values: Tensor, mask: Tensor) -> Tensor:
    """Per row, the value at the last masked position; 0 for a row with no masked entry."""
    if values.size(1) == 0:
        return values.new_zeros(values.size(0))
    last = mask.long().cumsum(1).argmax(1, keepdim=True)  # the count first reaches its total at the last masked entry
    return values.gather(1, last).squeeze(1).where(mask.any(1), 0.0)


def _extreme(values: Tensor, mask: Tensor, largest: bool) -> Tensor:
    """Per row, the largest (or smallest) value over `mask`; 0 for a row with no masked entry."""
    if values.size(1) == 0:
        return values.new_zeros(values.size(0))
    fill = float("-inf") if largest else float("inf")
    masked = values.masked_fill(~mask, fill)
    return (masked.amax(1) if largest else masked.amin(1)).where(mask.any(1), 0.0)


STATISTICS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "mean": masked_mean,
    "last": _last,
    "max": lambda values, mask: _extreme(values, mask, largest=True),
    "min": lambda values, mask: _extreme(values, mask, largest=False),
}
"""The official code's `_entropy_stats` over a span's tokens, in its order."""


def token_count(spans: Spans, span: str) -> Tensor:
    """(B,) float32: the span's tokens."""
    return _mask(spans, span).sum(1).float()


def distinct_tokens(spans: Spans, span: str) -> Tensor:
    """(B,) float32: the distinct token ids among the span's tokens (each row's ids sorted, padding first)."""
    mask = _mask(spans, span)
    if mask.size(1) == 0:
        return mask.new_zeros(mask.size(0)).float()
    ordered = spans.completion_ids.long().masked_fill(~mask, -1).sort(1).values  # ids are >= 0: -1 marks outside
    starts = (ordered[:, 1:] != ordered[:, :-1]) & (ordered[:, 1:] >= 0)  # where each distinct id begins, after the
    return (starts.sum(1) + (ordered[:, 0] >= 0)).float()  # first entry, which begins one when the span fills the row


def unique_token_ratio(spans: Spans, span: str) -> Tensor:
    """(B,) float32: distinct tokens / tokens of the span (0 where it is empty)."""
    count = token_count(spans, span)
    return (distinct_tokens(spans, span) / count.clamp(min=1.0)).where(count > 0, 0.0)


def repetition_ratio(spans: Spans, span: str) -> Tensor:
    """(B,) float32: 1 - `unique_token_ratio` (0 where the span is empty)."""
    count = token_count(spans, span)
    return (1.0 - unique_token_ratio(spans, span)).where(count > 0, 0.0)


def _entropy(span: str, statistic: str) -> Scalar:
    return Scalar(
        f"the {statistic} token entropy over the {span} span",
        lambda entropies, spans: STATISTICS[statistic](entropies, _mask(spans, span)),
    )


TEXT_SPANS = {
    "reasoning": "the text inside `<think>...</think>`",
    "answer": "the text inside `<answer>...</answer>`, else after the first `</think>`",
}
"""The spans the `text_*` scalars cut from the decoded text (text_spans.py), in the order of `Spans.text_masks`."""


def _text_entropy(span: str) -> Scalar:
    name = f"text_{span}_mean_token_entropy"

    def compute(entropies: Tensor, spans: Spans) -> Tensor:
        if spans.tokenizer is None:
            raise ValueError(
                f"The rollout scalar {name!r} cuts its span from the decoded text and needs the tokenizer: build the "
                "spans with features.feature_spans(..., tokenizer=...) (POISETrainer passes its processing class's)."
            )
        return masked_mean(entropies, spans.text_masks[list(TEXT_SPANS).index(span)])

    return Scalar(
        f"the mean token entropy over the {span} span as the POISE authors' reference (verl-recipe) cuts it from the "
        f"decoded text: {TEXT_SPANS[span]} (0 without it); needs the tokenizer",
        compute,
        reads_text=True,
    )


def _of_spans(text: str, compute: Callable[[Spans], Tensor]) -> Scalar:
    return Scalar(text, lambda entropies, spans: compute(spans))


def _difference(first: str, second: str) -> Scalar:
    return Scalar(
        f"{first} - {second}",
        lambda entropies, spans: column(first, entropies, spans) - column(second, entropies, spans),
    )


SCALARS: dict[str, Scalar] = {
    **{f"{span}_{stat}_token_entropy": _entropy(span, stat) for span in SPANS for stat in STATISTICS},
    "output_length": _of_spans("the number of generated tokens", lambda spans: token_count(spans, "output")),
    "think_tokens": _of_spans(
        "the number of the reasoning span's tokens", lambda spans: token_count(spans, "reasoning")
    ),
    "answer_tokens": _of_spans("the number of the answer span's tokens", lambda spans: token_count(spans, "answer")),
    "think_ratio": _of_spans(
        "think_tokens / output_length",
        lambda spans: token_count(spans, "reasoning") / token_count(spans, "output").clamp(min=1.0),
    ),
    "answer_ratio": _of_spans(
        "answer_tokens / output_length",
        lambda spans: token_count(spans, "answer") / token_count(spans, "output").clamp(min=1.0),
    ),
    **{
        f"{span}_unique_token_ratio": _of_spans(
            f"distinct tokens / tokens of the {span} span", lambda spans, span=span: unique_token_ratio(spans, span)
        )
        for span in SPANS
    },
    **{
        f"{span}_repetition_ratio": _of_spans(
            f"1 - {span}_unique_token_ratio", lambda spans, span=span: repetition_ratio(spans, span)
        )
        for span in ("output", "reasoning")
    },
    "entropy_gap_reasoning_answer": _difference("reasoning_mean_token_entropy", "answer_mean_token_entropy"),
    "answer_entropy_gap_vs_output": _difference("answer_mean_token_entropy", "output_mean_token_entropy"),
    "unique_gap_reasoning_output": _difference("reasoning_unique_token_ratio", "output_unique_token_ratio"),
    "repetition_gap_reasoning_output": _difference("reasoning_repetition_ratio", "output_repetition_ratio"),
    **{f"text_{span}_mean_token_entropy": _text_entropy(span) for span in TEXT_SPANS},
}
"""Every rollout scalar by name: the official code's 12 token-entropy statistics ({output, reasoning, answer} x {mean,
last, max, min}), its length features (the spans' token counts and their shares of the completion), its repetition
features (the share of distinct tokens, and 1 minus it) and the gaps between them it derives; then the reference's
mean entropies over its spans from the decoded text."""


def column(name: str, entropies: Tensor, spans: Spans) -> Tensor:
    """(B,) float32: the scalar `name` of each row, from its (B, T) entropies (made finite first) and the spans."""
    return SCALARS[name].compute(entropies.float().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0), spans).float()


def scalar_columns(names: Sequence[str], entropies: Tensor, spans: Spans) -> Tensor:
    """(B, len(names)) float32: the scalars `names` of each row, in order, from the (B, T) per-token entropies of its
    completion tokens and the spans `features.feature_spans` cut (which carry the completion's token ids), on the
    entropies' device. The one call that computes a scalar set's columns, during training and on stored rollouts."""
    out = entropies.float().new_zeros(entropies.size(0), len(names))
    for i, name in enumerate(names):
        out[:, i] = column(name, entropies, spans)
    return out
