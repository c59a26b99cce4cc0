"""The reasoning and answer spans of a completion cut from its decoded text, as the POISE authors' reference cuts them
for its entropy statistics (verl-project/verl-recipe, `poise/features.py`, `entropy_features`); the rollout scalars
`text_*` read them (columns.py), where the others read `features.feature_spans`' token-id spans.

The text is the completion's tokens decoded without special tokens. The reasoning is the text inside the first
`<think>...</think>` (none without an opening tag); the answer is the text inside the first `<answer>...</answer>`,
else what follows the first `</think>` with its leading whitespace dropped (none when nothing follows). A span's
tokens are those whose characters overlap it once the text is tokenized again with offsets. Where that does not
give back as many tokens as the completion has (a completion ending in a special EOS, which decoding drops, or one
that decodes to text tokenized otherwise) or the tokenizer gives no offsets, the reference falls back to counts: the
first k tokens stand for the reasoning and the last m for the answer, k and m the token counts of the spans' texts.

This module imports no torch (the masks are built with tensor methods), as columns.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
THINK_END = "</think>"

Span = tuple[int, int] | None  # [start, stop) characters of the text


def character_spans(text: str) -> tuple[Span, Span]:
    """The reasoning and answer spans of `text`, in characters (None: no such span)."""
    think, answer = THINK.search(text), ANSWER.search(text)
    reasoning = think.span(1) if think else None
    if answer:
        return reasoning, answer.span(1)
    if THINK_END not in text:
        return reasoning, None
    start = text.index(THINK_END) + len(THINK_END)
    start = len(text) - len(text[start:].lstrip())
    return reasoning, (start, len(text)) if start < len(text) else None


def text_spans(tokenizer: Any, ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """Indices into `ids` (a completion's tokens) of its reasoning and answer tokens, cut from its decoded text."""
    text = tokenizer.decode(list(ids), skip_special_tokens=True)
    spans = character_spans(text)
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if len(encoded["input_ids"]) == len(ids):
            offsets = encoded["offset_mapping"]
            reasoning, answer = (
                [
                    i
                    for i, (start, stop) in enumerate(offsets)
                    if span is not None and start < stop and stop > span[0] and start < span[1]
                ]
                for span in spans
            )
            return reasoning, answer
    except (ValueError, TypeError, KeyError, NotImplementedError):  # no offsets from this tokenizer: counts, below
        pass
    reasoning, answer = (
        0 if span is None else min(len(ids), len(tokenizer.encode(text[span[0] : span[1]], add_special_tokens=False)))
        for span in spans
    )
    return list(range(reasoning)), list(range(len(ids) - answer, len(ids)))


def text_span_masks(tokenizer: Any, completion_ids: Tensor, completion_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(B, C) bool masks of each row's reasoning and answer tokens, `text_spans` of its `completion_mask` tokens (the
    ones the policy generated), on the mask's device."""
    valid = completion_mask.bool().cpu()
    reasoning, answer = valid.new_zeros(valid.shape), valid.new_zeros(valid.shape)
    for row, (ids, kept) in enumerate(zip(completion_ids.tolist(), valid.tolist(), strict=True)):
        positions = [t for t, keep in enumerate(kept) if keep]
        for mask, indices in zip((reasoning, answer), text_spans(tokenizer, [ids[t] for t in positions]), strict=True):
            mask[row, [positions[i] for i in indices]] = True
    return reasoning.to(completion_mask.device), answer.to(completion_mask.device)
