"""One teacher-forced pass, captured: the pooled features of every candidate layer and, with a per-token baseline,
its capture on the same pass. The one helper the trainer calls around the pass; pure torch.

Every hook is registered inside the `with` block only and removed however it is left (`features.hooked`), so
generation, the reference pass and the training pass, which run the same layer modules, are never captured.
"""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from .features import FeatureLayout, FeatureSpans, PooledCapture, hooked
from .prefix import PrefixBatch, PrefixCapture


class PassCapture:
    """What the hooks of one pass hold: a `PooledCapture` per candidate layer and the token capture, if any."""

    def __init__(
        self, pooled: list[PooledCapture], spans: FeatureSpans, layout: FeatureLayout, tokens: PrefixCapture | None
    ):
        self.pooled, self.spans, self.layout, self.tokens = pooled, spans, layout, tokens

    def result(self, entropies: torch.Tensor) -> tuple[torch.Tensor, PrefixBatch | None]:
        """((B, C, D) features, one vector per candidate layer in order; the `PrefixBatch` or None), from the pass's
        own (B, T) entropies once it is over."""
        features = [self.layout.assemble(c.pooled(), entropies, self.spans) for c in self.pooled]
        return torch.stack(features, dim=1), None if self.tokens is None else self.tokens.batch(entropies)


@contextmanager
def capture_pass(
    layers: Sequence[nn.Module],
    spans: FeatureSpans,
    layout: FeatureLayout,
    tokens: PrefixCapture | None = None,
) -> Iterator[PassCapture]:
    """Hook each candidate layer with a pooling capture, and the first with `tokens` (the per-token baseline's
    capture, which reads one fixed layer), for the passes inside the `with` block; φ is laid out as `layout` says.
    The hooks are registered and removed together (`features.hooked`): no stop leaves one behind."""
    pooled = [PooledCapture(spans) for _ in layers]
    hooks: list[tuple[nn.Module, Callable]] = list(zip(layers, pooled, strict=True))
    if tokens is not None:
        hooks.append((layers[0], tokens))
    with hooked(hooks):
        yield PassCapture(pooled, spans, layout, tokens)
