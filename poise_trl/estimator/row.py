"""The feature row `[φ | partner reward | history]`, the one place that knows its layout. Pure torch.

A probe's input for rollout j is its features φ_j (one vector per candidate layer), then, with the partner-aware
probe, its own reward r_j (one column: the probe only ever serves j's partners), then, with the prompt history,
`history.HISTORY_COLUMNS` of its prompt from earlier steps. The columns after φ are never part of a PCA block. The
sampler's prompt-only value reads the prompt block of φ and the same history columns.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..heads.probe import PCABlock
from .history import HISTORY_COLUMNS


def append_reward_column(features: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """[φ_j, r_j]: the partner-aware probe's input, the rollout's own reward as one more (last) column.

    `features` is (N, D) or (N, C, D) (one vector per candidate layer); every slice gets the same reward column. The
    probe h(φ_j, r_j) only ever serves as the baseline of j's partners, so using r_j keeps their gradient unbiased.
    """
    if rewards.shape != features.shape[:1]:
        raise ValueError(f"Got {rewards.shape[0]} rewards for {features.shape[0]} feature rows.")
    # At least fp32: in bf16 a reward of 0.3 reads 0.30078125, and in fp16 a reward of 70,000 overflows to inf.
    dtype = torch.promote_types(features.dtype, torch.float32)
    column = rewards.to(dtype).view(-1, *([1] * (features.ndim - 1)))
    return torch.cat([features.to(dtype), column.expand(*features.shape[:-1], 1)], dim=-1)


@dataclass(frozen=True)
class FeatureRow:
    """Which columns follow φ: the partner's reward (`partner_reward`) and the prompt's history (`history`)."""

    partner_reward: bool = True
    history: bool = False

    @property
    def appended(self) -> int:
        """Columns after φ."""
        return int(self.partner_reward) + len(HISTORY_COLUMNS) * int(self.history)

    def slices(self, width: int) -> dict[str, slice]:
        """Column ranges of a row whose φ has `width` columns: "features", then "partner_reward" and "history" where
        the row holds them."""
        parts = {"features": width, "partner_reward": int(self.partner_reward)}
        parts["history"] = len(HISTORY_COLUMNS) * int(self.history)
        out, start = {}, 0
        for name, size in parts.items():
            if size:
                out[name] = slice(start, start + size)
                start += size
        return out

    def pca_dims(self, pca_dims: int | Sequence[PCABlock] | None) -> int | list[PCABlock] | None:
        """A head's `pca_dims` for this row: an integer k is the PCA of every φ column, the appended ones left out;
        blocks and None are kept (`check_pca` refuses blocks that reach past φ)."""
        if self.appended and isinstance(pca_dims, int) and pca_dims > 0:
            return [(0, -self.appended, pca_dims)]
        return pca_dims

    def check_pca(self, pca_dims: int | Sequence[PCABlock] | None, width: int) -> None:
        """Refuse PCA blocks that cover a column after φ's `width`."""
        if not self.appended or pca_dims is None or isinstance(pca_dims, int):
            return
        if any(k > 0 and int(stop) > width for _, stop, k in pca_dims):
            first = "the partner-reward column" if self.partner_reward else "the first history column"
            raise ValueError(
                f"pca_dims={pca_dims} covers column {width}, {first}: PCA blocks must lie within the {width} "
                "feature columns."
            )

    def assemble(
        self, features: torch.Tensor, rewards: torch.Tensor, history: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The (N, C, width + appended) rows of (N, C, width) φ, the (N,) rewards (0 where not finite) and the (N, H)
        `history` columns of each row's prompt (the same for every candidate layer), at least fp32 past φ."""
        if self.partner_reward:
            features = append_reward_column(features, torch.where(torch.isfinite(rewards), rewards, 0.0))
        if self.history != (history is not None):
            raise ValueError(f"This row {'needs' if self.history else 'has no'} history columns.")
        if history is not None:
            dtype = torch.promote_types(features.dtype, torch.float32)
            columns = history.to(features.device, dtype).unsqueeze(1).expand(-1, features.size(1), -1)
            features = torch.cat([features.to(dtype), columns], dim=-1)
        return features

    def project(self, rows: torch.Tensor, to: "FeatureRow") -> torch.Tensor:
        """`rows` of this layout with only the columns of the layout `to`, which may leave out the partner's reward
        or the history but cannot add them."""
        if (to.partner_reward and not self.partner_reward) or (to.history and not self.history):
            raise ValueError(f"Rows of {self} do not hold the columns of {to}.")
        width = rows.size(-1) - self.appended
        mine = self.slices(width)
        keep = [mine["features"]] + [mine[name] for name in ("partner_reward", "history") if getattr(to, name)]
        return torch.cat([rows[..., part] for part in keep], dim=-1)

    def assemble_prompt(self, prompt_features: torch.Tensor, history: torch.Tensor | None) -> torch.Tensor:
        """A candidate prompt's inputs to the prompt-only value, laid out as `prompt_inputs` lays out a buffered
        row's: its (M, width) prompt block, then its (M, H) history where the row holds one."""
        if self.history != (history is not None):
            raise ValueError(f"This row {'needs' if self.history else 'has no'} history columns.")
        if history is None:
            return prompt_features
        return torch.cat([prompt_features, history.to(prompt_features.dtype)], dim=1)

    def prompt_inputs(self, rows: torch.Tensor, columns: tuple[int, int]) -> torch.Tensor:
        """The prompt-only value's inputs of (N, width + appended) rows: φ's prompt block [start, stop), then the
        history columns."""
        start, stop = columns
        parts = [rows[:, start:stop]]
        if self.history:
            parts.append(rows[:, self.slices(rows.size(1) - self.appended)["history"]])
        return torch.cat(parts, dim=1)

    def prompt_pca_dims(self, columns: tuple[int, int], k: int) -> list[PCABlock] | None:
        """The prompt-only head's PCA: k components of the prompt block (0: none), the history left out."""
        start, stop = columns
        return [(0, stop - start, k)] if k else None
