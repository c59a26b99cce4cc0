"""The value probe g_f: StandardScaler -> optional per-block PCA -> closed-form ridge, in torch.

It runs on whatever device its inputs live on (the GPU in real use) and solves in float64: DESIGN §4 measured a
float32 primal solve with alpha=0.01 to be numerically wrong when there are more features than examples.
"""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

PCABlock = tuple[int, int, int]  # (start column, stop column, n_components)


EXACT_SVD_MAX_DIM = 512


def _principal_axes(block: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k principal axes (k, D) of a centred block: exact SVD for small blocks, seeded randomized SVD beyond
    `EXACT_SVD_MAX_DIM` (as sklearn's PCA 'auto' solver does), which is ~7x faster at the Qwen3-4B size on CPU."""
    if min(block.shape) <= EXACT_SVD_MAX_DIM:
        return torch.linalg.svd(block, full_matrices=False)[2][:k]
    with torch.random.fork_rng(devices=[block.device] if block.is_cuda else []):
        torch.manual_seed(0)
        _, _, v = torch.svd_lowrank(block, q=min(k + 10, *block.shape), niter=4)
    return v[:, :k].T


class ValueProbe:
    """A sklearn-like ridge probe on torch tensors.

    With `pca_dims=None, clip=None` it reproduces `make_pipeline(StandardScaler(), Ridge(alpha))`.

    Args:
        alpha: ridge penalty.
        pca_dims: None (no PCA), an int (PCA of all columns), or (start, stop, k) blocks: columns [start, stop) are
            replaced by their top-k principal components; other columns pass through. k is capped by the number of
            rows and columns available at fit time (`fitted_pca_dims` records what was used).
        clip: None, a (low, high) pair, or "observed" to clip to the range of targets seen in `fit`.
    """

    def __init__(
        self,
        alpha: float = 1.0,
        pca_dims: int | Sequence[PCABlock] | None = None,
        clip: tuple[float, float] | str | None = "observed",
    ):
        if alpha <= 0:
            raise ValueError(f"alpha={alpha} must be > 0.")
        if isinstance(clip, str) and clip != "observed":
            raise ValueError(f"clip={clip!r}: use None, (low, high) or 'observed'.")
        self.alpha = float(alpha)
        self.pca_dims = pca_dims
        self.clip = clip
        self._state: dict[str, torch.Tensor] = {}

    @property
    def is_fitted(self) -> bool:
        return "coef" in self._state

    def _blocks(self, n_features: int) -> list[PCABlock]:
        if self.pca_dims is None:
            return []
        if isinstance(self.pca_dims, int):
            return [(0, n_features, self.pca_dims)] if self.pca_dims > 0 else []
        blocks = sorted((int(a), int(b), int(k)) for a, b, k in self.pca_dims if k > 0)
        for (_, stop, _), (start, _, _) in zip(blocks, blocks[1:], strict=False):
            if start < stop:
                raise ValueError(f"PCA blocks overlap: {blocks}")
        if blocks and (blocks[0][0] < 0 or blocks[-1][1] > n_features):
            raise ValueError(f"PCA blocks {blocks} exceed the {n_features} feature columns.")
        return blocks

    def _design(self, x: torch.Tensor) -> torch.Tensor:
        """Standardize, then project each PCA block onto its components; other columns pass through."""
        s = self._state
        z = (x.to(torch.float64) - s["mean"]) / s["scale"]
        parts, cursor = [], 0
        for i, start in enumerate(s["pca_start"].tolist()):
            stop = int(s["pca_stop"][i])
            parts += [z[:, cursor:start], z[:, start:stop] @ s[f"pca_components_{i}"].T]
            cursor = stop
        parts.append(z[:, cursor:])
        return torch.cat(parts, dim=1)

    def fit(self, x: torch.Tensor, y: torch.Tensor) -> "ValueProbe":
        """Fit on (N, D) features and (N,) targets; rows must be finite (the trainer filters them)."""
        if x.ndim != 2 or y.shape != (x.size(0),):
            raise ValueError(f"fit expects X (N, D) and y (N,), got {tuple(x.shape)} and {tuple(y.shape)}.")
        if x.size(0) < 2:
            raise ValueError(f"fit needs at least 2 examples, got {x.size(0)}.")
        if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            raise ValueError("fit got non-finite features or targets; drop those rows first.")
        x64, y64 = x.to(torch.float64), y.to(torch.float64)
        n, d = x64.shape
        mean = x64.mean(0)
        scale = x64.std(0, unbiased=False)
        # sklearn's StandardScaler leaves constant columns unscaled instead of dividing by zero.
        scale = torch.where(scale > 1e-12 * mean.abs().clamp(min=1.0), scale, torch.ones_like(scale))
        self._state = {"mean": mean, "scale": scale}
        blocks = self._blocks(d)
        self._state["pca_start"] = torch.tensor([b[0] for b in blocks], dtype=torch.long)
        self._state["pca_stop"] = torch.tensor([b[1] for b in blocks], dtype=torch.long)
        z = (x64 - mean) / scale
        for i, (start, stop, k) in enumerate(blocks):
            block = z[:, start:stop]
            block = block - block.mean(0)
            self._state[f"pca_components_{i}"] = _principal_axes(block, min(k, n, stop - start))
        design = self._design(x64)
        design_mean = design.mean(0)
        centered = design - design_mean
        target_mean = y64.mean()
        yc = y64 - target_mean
        eye = torch.eye(min(n, centered.size(1)), dtype=torch.float64, device=x.device)
        if centered.size(1) <= n:  # primal: (F'F + aI) w = F'y
            coef = torch.linalg.solve(centered.T @ centered + self.alpha * eye, centered.T @ yc)
        else:  # dual: w = F'(FF' + aI)^-1 y, the cheaper solve when D > N
            coef = centered.T @ torch.linalg.solve(centered @ centered.T + self.alpha * eye, yc)
        self._state["coef"] = coef
        self._state["intercept"] = (target_mean - design_mean @ coef).reshape(1)
        low, high = (y64.min(), y64.max()) if self.clip == "observed" else (self.clip or (-torch.inf, torch.inf))
        self._state["clip"] = torch.tensor([float(low), float(high)], dtype=torch.float64, device=x.device)
        return self

    def predict(self, x: torch.Tensor, return_unclipped: bool = False) -> torch.Tensor:
        """(N,) float32 predictions, clipped to the reward range; `return_unclipped` also returns the raw values."""
        if not self.is_fitted:
            raise RuntimeError("ValueProbe.predict called before fit.")
        state = {k: v.to(x.device) for k, v in self._state.items()}
        self._state = state
        raw = self._design(x) @ state["coef"] + state["intercept"]
        clipped = raw.clamp(min=state["clip"][0], max=state["clip"][1]).float()
        return (clipped, raw.float()) if return_unclipped else clipped

    @property
    def fitted_pca_dims(self) -> list[int]:
        return [int(self._state[f"pca_components_{i}"].size(0)) for i in range(len(self._state.get("pca_start", [])))]

    def config(self) -> dict[str, Any]:
        pca = (
            self.pca_dims
            if self.pca_dims is None or isinstance(self.pca_dims, int)
            else list(map(list, self.pca_dims))
        )
        return {
            "alpha": self.alpha,
            "pca_dims": pca,
            "clip": list(self.clip) if isinstance(self.clip, tuple) else self.clip,
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().contiguous() for k, v in self._state.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._state = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in state.items()}


class ProbeBuffer:
    """A sliding buffer of (feature, target) examples; the oldest rows are evicted first."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1.")
        self.capacity = capacity
        self.features: torch.Tensor | None = None
        self.targets: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.targets is None else self.targets.numel()

    def add(self, features: torch.Tensor, targets: torch.Tensor) -> None:
        """Append rows in order, keeping the newest `capacity`. Features are stored in float32 on the CPU."""
        features, targets = features.detach().float().cpu(), targets.detach().float().cpu()
        if self.features is not None:
            if features.size(1) != self.features.size(1):
                raise ValueError(
                    f"Feature width changed from {self.features.size(1)} to {features.size(1)}: the feature "
                    "configuration (layer, features, model) must stay fixed for one buffer."
                )
            features, targets = torch.cat([self.features, features]), torch.cat([self.targets, targets])
        self.features, self.targets = features[-self.capacity :], targets[-self.capacity :]

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.features is None:
            return {}
        return {"features": self.features.contiguous(), "targets": self.targets.contiguous()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.features, self.targets = state.get("features"), state.get("targets")


def save_probe_file(
    path: str | Path, probe: ValueProbe, buffer: ProbeBuffer | None = None, metadata: dict[str, Any] | None = None
) -> None:
    """Write `path` (safetensors: probe and buffer tensors) and `path` + '.json' (config). Nothing is pickled."""
    path = Path(path)
    tensors = {f"probe.{k}": v for k, v in probe.state_dict().items()}
    if buffer is not None:
        tensors.update({f"buffer.{k}": v for k, v in buffer.state_dict().items()})
    save_file(tensors, str(path))
    info = {"probe": probe.config(), "buffer_capacity": None if buffer is None else buffer.capacity}
    info.update(metadata or {})
    path.with_suffix(path.suffix + ".json").write_text(json.dumps(info, indent=2, sort_keys=True))


def load_probe_file(path: str | Path) -> tuple[ValueProbe, ProbeBuffer | None, dict[str, Any]]:
    """Inverse of `save_probe_file`; safetensors cannot execute code, so a downloaded file is safe to read."""
    path = Path(path)
    info = json.loads(path.with_suffix(path.suffix + ".json").read_text())
    tensors = load_file(str(path))
    cfg = info["probe"]
    pca = cfg["pca_dims"] if cfg["pca_dims"] is None or isinstance(cfg["pca_dims"], int) else cfg["pca_dims"]
    clip = tuple(cfg["clip"]) if isinstance(cfg["clip"], list) else cfg["clip"]
    probe = ValueProbe(alpha=cfg["alpha"], pca_dims=pca, clip=clip)
    probe.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("probe.")})
    buffer = None
    if info.get("buffer_capacity") is not None:
        buffer = ProbeBuffer(info["buffer_capacity"])
        buffer.load_state_dict({k[7:]: v for k, v in tensors.items() if k.startswith("buffer.")})
    return probe, buffer, info
