"""POISE features φ(x, y) from one teacher-forced pass: pooled hidden states of one layer plus rollout scalars.

Pure torch (no TRL, no transformers): the trainer hands in masks, ids and per-token entropies; this module finds
the spans, hooks one decoder layer for exactly one scoped pass, and pools as the pass runs so that no (B, T, d)
activation outlives its layer call. `FeatureLayout` lays φ out; the rollout scalars are columns.py's.
"""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .columns import DEFAULT_SCALARS, scalar_columns
from .text_spans import text_span_masks

FEATURE_BLOCKS = ("prompt", "reasoning", "entropy", "length")
HIDDEN_BLOCKS = ("prompt", "reasoning")
# Default candidates of probe_layer="auto", as fractions of the depth (they include the fixed default's 0.53).
AUTO_LAYER_FRACTIONS = (0.25, 0.53, 0.75, 1.0)
# Model attributes tried, in order, to find the list of decoder blocks.
_LAYER_PATHS = ("model.layers", "model.language_model.layers", "transformer.h", "gpt_neox.layers", "layers")


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a causal LM, looking through PEFT (`get_base_model`) and `get_decoder()`."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    candidates: list[nn.Module] = []
    if hasattr(model, "get_decoder"):
        candidates.append(model.get_decoder())
    candidates.append(model)
    for root in candidates:
        if isinstance(getattr(root, "layers", None), nn.ModuleList):
            return root.layers
        for path in _LAYER_PATHS:
            module = root
            for attr in path.split("."):
                module = getattr(module, attr, None)
            if isinstance(module, nn.ModuleList) and len(module) > 0:
                return module
    raise ValueError(
        f"Cannot find the decoder layer list of {type(model).__name__}: tried get_decoder().layers and "
        f"{', '.join(_LAYER_PATHS)}. POISE hooks one decoder block; pass a causal LM with one of these attributes."
    )


def resolve_layer_index(layer: int | None, num_layers: int) -> int:
    """None -> round(0.53·L) (layer 19 of 36, the paper's choice); negative values count from the end."""
    if layer is None:
        return min(num_layers - 1, round(0.53 * num_layers))
    index = layer + num_layers if layer < 0 else layer
    if not 0 <= index < num_layers:
        raise ValueError(
            f"probe_layer={layer} is out of range for a model with {num_layers} decoder layers: use an index in "
            f"[{-num_layers}, {num_layers - 1}], or None for round(0.53 * num_layers)."
        )
    return index


def layer_candidates(candidates: Sequence[int] | None, num_layers: int) -> list[int]:
    """Sorted, de-duplicated layer indices for probe_layer="auto"; None: `AUTO_LAYER_FRACTIONS` of the depth."""
    if candidates is None:
        candidates = [min(num_layers - 1, round(f * num_layers)) for f in AUTO_LAYER_FRACTIONS]
    return sorted({resolve_layer_index(c, num_layers) for c in candidates})


def find_last_subsequence(ids: torch.Tensor, mask: torch.Tensor, pattern: Sequence[int]) -> torch.Tensor:
    """Index of the last token of the last occurrence of `pattern` within each row's valid tokens; -1 if none.

    Args:
        ids: (B, C) token ids.
        mask: (B, C) 1 for valid tokens.
        pattern: the marker's token ids.
    """
    m = len(pattern)
    batch, length = ids.shape
    if m == 0 or m > length:
        return torch.full((batch,), -1, dtype=torch.long, device=ids.device)
    target = torch.as_tensor(list(pattern), device=ids.device, dtype=ids.dtype)
    windows = ids.unfold(1, m, 1)  # (B, C-m+1, m)
    valid = mask.bool().unfold(1, m, 1).all(-1)
    hits = (windows == target).all(-1) & valid
    ends = torch.arange(m - 1, length, device=ids.device).expand(batch, -1)
    return torch.where(hits, ends, torch.full_like(ends, -1)).amax(dim=1)


@dataclass
class FeatureSpans:
    """Where each feature comes from, computed from masks before the pass.

    `pool_index`/`pool_weight` are (B, 2, n): positions (in the concatenated prompt+completion sequence) of the last
    n prompt tokens and the last n reasoning tokens, with weight 0 on slots a short span cannot fill.
    `completion_mask` marks the completion tokens the policy generated (tool results and environment feedback
    excluded); `reasoning_mask`/`answer_mask` are (B, C) subsets of it for the rollout scalars (columns.py), which
    also read the (B, C) `completion_ids`, and the scalars that cut their spans from the decoded text the `tokenizer`
    (None: not known, and those scalars refuse).
    """

    pool_index: torch.Tensor
    pool_weight: torch.Tensor
    completion_mask: torch.Tensor
    reasoning_mask: torch.Tensor
    answer_mask: torch.Tensor
    completion_ids: torch.Tensor
    tokenizer: Any = None

    def rows(self, index: torch.Tensor) -> "FeatureSpans":
        """The spans of some of the batch's rows (a micro-batch the loss's forward sees), in `index` order."""
        index = index.to(self.pool_index.device)
        tensors = [f.name for f in fields(self) if f.name != "tokenizer"]
        return replace(self, **{name: getattr(self, name)[index] for name in tensors})

    @cached_property
    def text_masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, C) masks of the reasoning and answer tokens cut from the decoded text, as the POISE authors'
        reference cuts them (text_spans.py), among the generated tokens; computed once, on first use."""
        if self.tokenizer is None:
            raise ValueError("These spans have no tokenizer to decode the completions with: pass feature_spans one.")
        return text_span_masks(self.tokenizer, self.completion_ids, self.completion_mask)


def _last_valid(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row (0 for an all-zero or zero-width row; its count is 0 so it is never used)."""
    length = mask.size(1)
    if length == 0:
        return torch.zeros(mask.size(0), dtype=torch.long, device=mask.device)
    return length - 1 - mask.flip(1).float().argmax(dim=1)


def last_n_positions(mask: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the last n ones of each row of `mask` (latest first) and weight 1 on the slots they fill.

    The ones need not be contiguous: a tool result inside a completion leaves a gap that pooling skips."""
    batch, length = mask.shape
    positions = torch.arange(length, device=mask.device).expand(batch, -1)
    score = torch.where(mask.bool(), positions, torch.full_like(positions, -1))
    top = score.topk(min(n, length), dim=1).values
    top = torch.cat([top, top.new_full((batch, n - top.size(1)), -1)], dim=1)
    return top.clamp(min=0), (top >= 0).float()


def feature_spans(
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    pool_tokens: int,
    marker_ids: Sequence[int] | None,
    generated_mask: torch.Tensor | None = None,
    tokenizer: Any = None,
) -> FeatureSpans:
    """Spans for pooling and the rollout scalars (paper §3), over the tokens the policy generated.

    `generated_mask` (B, C) is 0 on completion tokens the policy did not write (TRL's `tool_mask`: tool results,
    environment feedback); None means it wrote them all. Only generated tokens are pooled, enter the rollout
    scalars or count as length, and only a marker the policy wrote ends the reasoning span, so a `</think>` inside
    a tool result cannot move the cut. The reasoning span runs from the first completion token to the last occurrence
    of the marker, marker included; without a marker it is the whole completion. The answer span is what follows the
    marker; without a marker it is the last n generated tokens. `tokenizer` (the trainer's processing class) is
    for the rollout scalars that cut their spans from the decoded text instead (`FeatureSpans.text_masks`).
    """
    prompt_len = prompt_mask.size(1)
    generated = completion_mask.bool()
    if generated_mask is not None:
        generated = generated & generated_mask.bool()
    positions = torch.arange(generated.size(1), device=generated.device).unsqueeze(0)
    last_generated = _last_valid(generated)

    marker_end = (
        find_last_subsequence(completion_ids, generated, marker_ids)
        if marker_ids
        else torch.full_like(last_generated, -1)
    )
    has_marker = marker_end >= 0
    reasoning_end = torch.where(has_marker, marker_end, last_generated)
    reasoning_mask = generated & (positions <= reasoning_end.unsqueeze(1))
    generated_after = generated.flip(1).cumsum(1).flip(1)  # generated tokens at or after each position
    tail = generated & (generated_after <= pool_tokens)
    answer_mask = torch.where(has_marker.unsqueeze(1), generated & ~reasoning_mask, tail)

    prompt_index, prompt_weight = last_n_positions(prompt_mask, pool_tokens)
    reasoning_index, reasoning_weight = last_n_positions(reasoning_mask, pool_tokens)
    return FeatureSpans(
        pool_index=torch.stack([prompt_index, prompt_len + reasoning_index], dim=1),
        pool_weight=torch.stack([prompt_weight, reasoning_weight], dim=1),
        completion_mask=generated,
        reasoning_mask=reasoning_mask,
        answer_mask=answer_mask,
        completion_ids=completion_ids,
        tokenizer=tokenizer,
    )


def pool_hidden(hidden: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Weighted mean of `hidden` (b, T, d) at `index` (b, k, n) -> (b, k, d) in float32; empty spans give 0."""
    rows = torch.arange(hidden.size(0), device=hidden.device).view(-1, 1, 1)
    index = index.to(hidden.device).clamp(max=hidden.size(1) - 1)  # empty spans point past zero-width completions
    picked = hidden[rows, index].float()  # (b, k, n, d): only n tokens per span are touched
    weight = weight.to(picked.device)
    # Unfilled slots point at padding; select rather than multiply so a NaN there cannot leak into the mean.
    picked = torch.where(weight.unsqueeze(-1) > 0, picked, torch.zeros_like(picked))
    return (picked * weight.unsqueeze(-1)).sum(2) / weight.sum(2, keepdim=True).clamp(min=1.0)


class PooledCapture:
    """Receives the hooked layer's output chunk by chunk and keeps only the pooled (B, 2, d) states."""

    def __init__(self, spans: FeatureSpans):
        self.spans = spans
        self.chunks: list[torch.Tensor] = []
        self.rows_seen = 0
        self.calls = 0

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        rows = slice(self.rows_seen, self.rows_seen + hidden.size(0))
        self.chunks.append(pool_hidden(hidden.detach(), self.spans.pool_index[rows], self.spans.pool_weight[rows]))
        self.rows_seen = rows.stop
        self.calls += 1

    def pooled(self) -> torch.Tensor:
        """(B, 2, d): [last-n prompt mean, last-n reasoning mean] per row."""
        expected = self.spans.pool_index.size(0)
        if self.rows_seen != expected:
            raise RuntimeError(
                f"The hooked layer saw {self.rows_seen} rows in {self.calls} calls, expected {expected}: the capture "
                "must wrap exactly one teacher-forced pass over the batch."
            )
        return torch.cat(self.chunks, dim=0)


def _remove(handles: Sequence[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


@contextmanager
def hooked(hooks: Sequence[tuple[nn.Module, Callable]]) -> Iterator[None]:
    """Each (module, forward hook) of `hooks` registered for the `with` block only, and removed however the block is
    left: every hook is registered inside the `try` whose `finally` removes it (no stop between the two), and the
    removal runs again should a stop interrupt it (removing a hook twice is harmless), so no KeyboardInterrupt,
    wherever it lands in this module, leaves a hook on a module."""
    handles: list[RemovableHandle] = []
    try:
        try:
            for module, hook in hooks:
                handles.append(module.register_forward_hook(hook))
            yield
        finally:
            _remove(handles)
    finally:
        _remove(handles)  # again: a stop inside the removal above leaves the rest to this one


@contextmanager
def capture_layer(layer: nn.Module, capture: FeatureSpans | Callable) -> Iterator:
    """Hook `layer` with `capture` for the passes inside the `with` block only (`hooked`: removed however the block
    is left).

    `capture` is the hook (a `PooledCapture`, a `prefix.PrefixCapture`, ...) or, for the pooled sequence features,
    the `FeatureSpans` a `PooledCapture` is made from; the block receives the hook."""
    hook = PooledCapture(capture) if isinstance(capture, FeatureSpans) else capture
    with hooked([(layer, hook)]):
        yield hook


@dataclass(frozen=True)
class FeatureLayout:
    """φ as ordered column sources: the hidden-state blocks `blocks` names ("prompt", "reasoning": the pooled states,
    d columns each, each its own PCA block), then the rollout scalars (columns.py, one column each, never in a PCA
    block): `scalars` in order where `blocks` holds "entropy" (named after its default, the paper's three entropy
    statistics), and "output_length" where it holds "length". Blocks are laid out in `FEATURE_BLOCKS` order whatever
    order `blocks` gives. `POISEConfig.probe_features` and `probe_scalars` set it (`from_config`)."""

    blocks: tuple[str, ...] = ("prompt", "reasoning", "entropy")
    scalars: tuple[str, ...] = DEFAULT_SCALARS

    @classmethod
    def from_config(cls, config: Any) -> "FeatureLayout":
        return cls(tuple(config.probe_features), tuple(config.probe_scalars))

    @property
    def read_scalars(self) -> tuple[str, ...]:
        """The scalars of `scalars` that φ holds: all of them with the "entropy" block, none without (what the
        estimator's file records)."""
        return self.scalars if "entropy" in self.blocks else ()

    def block_scalars(self) -> dict[str, tuple[str, ...]]:
        """The scalar blocks of φ and the scalars each holds, in order."""
        return {"entropy": self.scalars, "length": ("output_length",)}

    def sizes(self, hidden_size: int) -> dict[str, int]:
        """Width of each block of φ, in `FEATURE_BLOCKS` order: d, d, len(scalars), 1."""
        widths = {name: hidden_size for name in HIDDEN_BLOCKS}
        widths.update({name: len(scalars) for name, scalars in self.block_scalars().items()})
        return {name: widths[name] for name in FEATURE_BLOCKS if name in self.blocks}

    def slices(self, hidden_size: int) -> dict[str, tuple[int, int]]:
        """Column range [start, stop) of each block in φ."""
        slices, start = {}, 0
        for name, width in self.sizes(hidden_size).items():
            slices[name] = (start, start + width)
            start += width
        return slices

    def pca_blocks(
        self, hidden_size: int, pca_dims: Sequence[int], cap_at_width: bool = False
    ) -> list[tuple[int, int, int]]:
        """(start, stop, k) column blocks for a head's `pca_dims` from [prompt k, reasoning k] (0 = no PCA).

        `cap_at_width` caps k at the block's width, for a preset's dims, which were chosen for a large model (a small
        model keeps every component); an explicit k wider than its block is a mistake and raises.
        """
        slices, out = self.slices(hidden_size), []
        for name, k in zip(HIDDEN_BLOCKS, pca_dims, strict=True):
            if name in slices and k > 0:
                start, stop = slices[name]
                if cap_at_width:
                    k = min(k, stop - start)
                elif k > stop - start:
                    raise ValueError(
                        f"probe_pca_dims asks for {k} components of the {name} block, which has only {stop - start} "
                        f"columns (hidden size {hidden_size}): use at most {stop - start}, or 0 for no PCA."
                    )
                out.append((start, stop, k))
        return out

    def assemble(self, pooled: torch.Tensor, entropies: torch.Tensor, spans: FeatureSpans) -> torch.Tensor:
        """(B, D) φ of the (B, 2, d) pooled [prompt, reasoning] states, the (B, T) per-token entropies and the spans,
        on the pooled states' device."""
        parts = {"prompt": lambda: pooled[:, 0], "reasoning": lambda: pooled[:, 1]}
        for name, scalars in self.block_scalars().items():
            parts[name] = lambda scalars=scalars: scalar_columns(scalars, entropies, spans).to(pooled.device)
        return torch.cat([parts[name]() for name in self.sizes(pooled.size(-1))], dim=1)
