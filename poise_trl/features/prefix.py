"""The per-prefix value V(x, y_<t): features of every completion token from one hooked layer, and its probe folded
into one affine map applied inside the hook. Pure torch (no TRL, no transformers).

Completion token t (0-based) is emitted by the state at sequence position e = P + t - 1 (P: the padded prompt width),
which has seen x and y_<t, never y_t. Its features read positions <= e only:

- prompt: the mean of the last n prompt tokens' states (as the sequence-level probe's prompt block);
- prefix: the mean of the states at the last n attended positions up to e (a causal running window);
- stats: `STATS`, from the entropies of the distributions that emitted tokens 0..t (token t's included: it is a
  function of the state at e) and the count of tokens generated before t; never the completion's length.

The probe stays StandardScaler (+PCA) + ridge, an affine map x @ w + b once folded (`ValueProbe.affine`). Pooling is
linear too, so w·(mean of states) = mean of (w·state): inside the hook each position's state is projected onto the
prefix block's weight, and a running mean of those (B, L) scalars gives every token's value. No (B, T, d) tensor
outlives the layer call. The probe learns from `samples` positions per rollout (full features, target: the
rollout's reward), drawn one per equal share of the row's generated tokens before the pass.
"""

from dataclasses import dataclass

import torch
from torch import nn

from ..heads.probe import ValueProbe
from .features import last_n_positions, pool_hidden

PREFIX_SAMPLES = 4  # tokens per rollout the probe learns from: one per quarter of its generated tokens
STATS = ("entropy_mean", "entropy", "entropy_window_mean", "tokens_before", "log_tokens_before")


def feature_width(hidden_size: int) -> int:
    """Width of a prefix feature row: [prompt (d) | prefix (d) | stats]."""
    return 2 * hidden_size + len(STATS)


def prefix_pca_blocks(hidden_size: int, pca_dims: tuple[int, int]) -> list[tuple[int, int, int]]:
    """(start, stop, k) blocks for `ValueProbe(pca_dims=...)` from [prompt k, prefix k] (0: no PCA on that block)."""
    blocks = [(0, hidden_size, pca_dims[0]), (hidden_size, 2 * hidden_size, pca_dims[1])]
    return [(start, stop, min(k, hidden_size)) for start, stop, k in blocks if k > 0]


@dataclass
class PrefixBatch:
    """One batch's per-prefix capture, rows in the order of the rewards.

    rows: (N, K, F) the sampled tokens' feature rows; sampled: (N, K) False where a row had no generated token;
    values: (N, T) every completion token's V(x, y_<t) from the map in use at capture time (None: no fitted head
    then); generated: (N, T) the tokens the policy wrote, the only ones that get a token advantage; tokens: (N, K)
    the completion token each row of `rows` describes."""

    rows: torch.Tensor
    sampled: torch.Tensor
    values: torch.Tensor | None
    generated: torch.Tensor
    tokens: torch.Tensor


@dataclass
class PrefixSpans:
    """Where each prefix feature comes from, computed from masks before the pass.

    `attended` (B, L) marks the positions of the concatenated prompt + completion that hold a token; `prompt_index`/
    `prompt_weight` (B, n) the last n prompt tokens; `generated` (B, T) the completion tokens the policy wrote (no
    padding, no tool result or environment feedback): only those get a value and an advantage. `tokens` (B, K) are
    the completion tokens whose full feature rows the probe learns from, `sampled` (B, K) False where the row has no
    generated token."""

    attended: torch.Tensor
    prompt_width: int
    prompt_index: torch.Tensor
    prompt_weight: torch.Tensor
    generated: torch.Tensor
    tokens: torch.Tensor
    sampled: torch.Tensor
    pool_tokens: int

    def rows(self, rows: slice | torch.Tensor) -> "PrefixSpans":
        """The spans of some of the batch's rows: a slice (a chunk the hooked layer sees) or an index tensor."""
        return PrefixSpans(
            self.attended[rows],
            self.prompt_width,
            self.prompt_index[rows],
            self.prompt_weight[rows],
            self.generated[rows],
            self.tokens[rows],
            self.sampled[rows],
            self.pool_tokens,
        )


def prefix_spans(
    prompt_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    pool_tokens: int,
    samples: int,
    generated_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    row_offset: int = 0,
) -> PrefixSpans:
    """Spans for a batch: prompt_mask (B, P) left-padded, completion_mask (B, T) right-padded, generated_mask (B, T)
    0 on tokens the policy did not write (TRL's `tool_mask`; None: it wrote them all). Sampled token k of a row is
    drawn uniformly within the k-th of `samples` equal shares of the row's generated tokens (`generator`: a CPU
    generator, for reproducible draws). The batch's rows are rows `row_offset`.. of one draw from `generator`, so a
    process holding a slice of the global batch draws what one process holding all of it would."""
    if pool_tokens < 1 or samples < 1:
        raise ValueError(f"pool_tokens={pool_tokens} and samples={samples} must both be >= 1.")
    generated = completion_mask.bool() & (True if generated_mask is None else generated_mask.bool())
    count = generated.sum(1, keepdim=True)  # (B, 1)
    share = torch.rand(row_offset + count.size(0), samples, generator=generator)[row_offset:].to(count.device)
    rank = ((torch.arange(samples, device=count.device) + share) * count / samples).long().clamp(max=count - 1)
    tokens = torch.searchsorted(generated.long().cumsum(1), rank + 1).clamp(max=max(generated.size(1) - 1, 0))
    prompt_index, prompt_weight = last_n_positions(prompt_mask, pool_tokens)
    return PrefixSpans(
        attended=torch.cat([prompt_mask.bool(), completion_mask.bool()], dim=1),
        prompt_width=prompt_mask.size(1),
        prompt_index=prompt_index,
        prompt_weight=prompt_weight,
        generated=generated,
        tokens=tokens,
        sampled=(count > 0).expand(-1, samples),
        pool_tokens=pool_tokens,
    )


def _window_mean(values: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """Mean of `values` (B, L, ...) over the masked positions among the last n up to each position (causal); 0
    where none. Exact: a sum over the window, not a difference of running sums."""
    weight = mask.to(values.dtype).view(*mask.shape, *([1] * (values.ndim - 2)))
    padded = torch.nn.functional.pad((values * weight).movedim(1, -1), (n - 1, 0))
    count = torch.nn.functional.pad(weight.movedim(1, -1), (n - 1, 0)).unfold(-1, n, 1).sum(-1)
    return (padded.unfold(-1, n, 1).sum(-1) / count.clamp(min=1)).movedim(-1, 1)


def prefix_stats(entropies: torch.Tensor, spans: PrefixSpans) -> torch.Tensor:
    """(B, T, len(STATS)) float32 `STATS` of every completion token, from tokens 0..t only (generated ones)."""
    generated = spans.generated.double()
    entropy = entropies.double().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0) * generated
    seen = generated.cumsum(1)
    before = seen - generated  # generated tokens before t
    columns = [
        entropy.cumsum(1) / seen.clamp(min=1),
        entropy,
        _window_mean(entropy, spans.generated, spans.pool_tokens),
        before,
        before.log1p(),
    ]
    return torch.stack(columns, dim=-1).float()


def _emitting(spans: PrefixSpans, values: torch.Tensor) -> torch.Tensor:
    """The entries of a (B, L, ...) per-position tensor at the positions that emit completion tokens 0..T-1."""
    start = spans.prompt_width - 1
    return values[:, start : start + spans.generated.size(1)]


@dataclass
class PrefixMap:
    """A fitted prefix probe as one affine map on the raw features: value = clip(prompt_mean·prompt +
    prefix_mean·prefix + stats_row·stats + bias). float32 weights, where the states are projected; float64 bias."""

    prompt: torch.Tensor  # (d,)
    prefix: torch.Tensor  # (d,)
    stats: torch.Tensor  # (len(STATS),)
    bias: torch.Tensor  # 0-d
    clip: torch.Tensor  # (2,) [low, high]

    @classmethod
    def fold(cls, probe: ValueProbe, hidden_size: int) -> "PrefixMap":
        """The map of a probe fitted on prefix feature rows (`feature_width(hidden_size)` columns)."""
        weight, bias = probe.affine()
        if weight.numel() != feature_width(hidden_size):
            raise ValueError(f"The probe has {weight.numel()} inputs, not {feature_width(hidden_size)}.")
        d = hidden_size
        return cls(weight[:d].float(), weight[d : 2 * d].float(), weight[2 * d :], bias, probe.state_dict()["clip"])

    def to(self, device: torch.device | str) -> "PrefixMap":
        return PrefixMap(*(t.to(device) for t in (self.prompt, self.prefix, self.stats, self.bias, self.clip)))

    def hidden_part(self, hidden: torch.Tensor, spans: PrefixSpans) -> torch.Tensor:
        """(b, T) float64: the hidden-state blocks' contribution to every completion token's value, from one chunk's
        (b, L, d) layer output; what the hook keeps instead of the states."""
        projected = hidden.float() @ torch.stack([self.prompt, self.prefix], dim=1).to(hidden.device)  # (b, L, 2)
        prompt = pool_hidden(projected[..., :1], spans.prompt_index[:, None], spans.prompt_weight[:, None])[:, 0]
        prefix = _window_mean(projected[..., 1].double(), spans.attended.to(hidden.device), spans.pool_tokens)
        return prompt.double() + _emitting(spans, prefix)

    def values(self, hidden_part: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        """(B, T) float32 clipped values from `hidden_part` and `prefix_stats`; 0 on tokens not generated is the
        caller's (`prefix_advantages` never reads them)."""
        device = stats.device
        raw = hidden_part.to(device) + stats.double() @ self.stats.to(device) + self.bias.to(device)
        clip = self.clip.to(device)
        return raw.clamp(min=clip[0], max=clip[1]).float()


def hidden_rows(hidden: torch.Tensor, spans: PrefixSpans, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """(b, K, 2d) float32 [prompt mean | prefix window mean] at completion tokens `tokens` (b, K) (default: the
    sampled ones) of one chunk's (b, L, d) layer output: n states per token are touched, never a (b, T, d) copy."""
    tokens = spans.tokens if tokens is None else tokens
    end = (spans.prompt_width - 1 + tokens).to(hidden.device)  # the emitting position
    offsets = torch.arange(spans.pool_tokens, device=hidden.device)
    index = (end.unsqueeze(-1) - offsets).clamp(min=0)  # (b, K, n): the window, latest first
    attended = spans.attended.to(hidden.device)
    weight = (torch.gather(attended, 1, index.flatten(1)).view_as(index) & (end.unsqueeze(-1) >= offsets)).float()
    prompt = pool_hidden(hidden, spans.prompt_index[:, None], spans.prompt_weight[:, None])  # (b, 1, d)
    return torch.cat([prompt.expand(-1, tokens.size(1), -1), pool_hidden(hidden, index, weight)], dim=-1)


def feature_rows(hidden_rows: torch.Tensor, stats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, K, feature_width) full feature rows: `hidden_rows` beside the `prefix_stats` of the same tokens."""
    picked = torch.gather(stats, 1, tokens.to(stats.device)[..., None].expand(-1, -1, stats.size(-1)))
    return torch.cat([hidden_rows, picked.to(hidden_rows.device)], dim=-1)


class PrefixCapture:
    """Receives the hooked layer's output chunk by chunk; keeps the sampled tokens' (b, K, 2d) hidden rows and,
    given a map, every token's (b, T) hidden part of the value."""

    def __init__(self, spans: PrefixSpans, prefix_map: PrefixMap | None):
        self.spans, self.map = spans, prefix_map
        self.rows: list[torch.Tensor] = []
        self.parts: list[torch.Tensor] = []
        self.rows_seen = 0

    def for_rows(self, index: torch.Tensor) -> "PrefixCapture":
        """A fresh capture of some of the batch's rows (a micro-batch the loss's forward sees), in `index` order,
        with the same map."""
        return PrefixCapture(self.spans.rows(index.to(self.spans.generated.device)), self.map)

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
        hidden = (output[0] if isinstance(output, tuple) else output).detach()
        spans = self.spans.rows(slice(self.rows_seen, self.rows_seen + hidden.size(0)))
        self.rows.append(hidden_rows(hidden, spans))
        if self.map is not None:
            self.parts.append(self.map.hidden_part(hidden, spans))
        self.rows_seen += hidden.size(0)

    def batch(self, entropies: torch.Tensor) -> PrefixBatch:
        """The pass's `PrefixBatch` (feature rows of the sampled tokens, every token's value without a map: None)
        once the pass is over; `entropies` (B, T) are the pass's own."""
        if self.rows_seen != self.spans.generated.size(0):
            raise RuntimeError(
                f"The hooked layer saw {self.rows_seen} rows, expected {self.spans.generated.size(0)}: the capture "
                "must wrap exactly one teacher-forced pass over the batch."
            )
        stats = prefix_stats(entropies, self.spans)
        rows = feature_rows(torch.cat(self.rows), stats, self.spans.tokens)
        values = None if self.map is None else self.map.values(torch.cat(self.parts), stats.to(self.parts[0].device))
        return PrefixBatch(rows, self.spans.sampled, values, self.spans.generated, self.spans.tokens)
