"""The value probe g_f: StandardScaler -> optional per-block PCA -> closed-form ridge, in torch.

It runs on whatever device its inputs live on (the GPU in real use) and solves in float64: DESIGN §4 measured a
float32 primal solve with alpha=0.01 to be numerically wrong when there are more features than examples.
"""

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch

PCABlock = tuple[int, int, int]  # (start column, stop column, n_components)


def _principal_axes(block: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k principal axes (k, D) of a centred (N, D) block, with scikit-learn's PCA `svd_solver="auto"` choice, so
    the probe captures the subspace its reference would: an exact SVD for tall-and-narrow or small blocks, otherwise
    (every real model's width) a seeded randomized SVD with 10 oversamples and 7 power iterations when k is under
    10% of the smaller side (4 otherwise); about 7x faster than the exact SVD at the Qwen3-4B size on CPU."""
    rows, cols = block.shape
    tall_and_narrow = cols <= 1000 and rows >= 10 * cols  # sklearn: "covariance_eigh", exact
    if tall_and_narrow or max(rows, cols) <= 500 or not 1 <= k < 0.8 * min(rows, cols):
        return torch.linalg.svd(block, full_matrices=False)[2][:k]
    with torch.random.fork_rng(devices=[block.device] if block.is_cuda else []):
        torch.manual_seed(0)
        niter = 7 if k < 0.1 * min(rows, cols) else 4
        _, _, v = torch.svd_lowrank(block, q=min(k + 10, rows, cols), niter=niter)
    return v[:, :k].T


def _solve_spd(gram: torch.Tensor, alpha: float, rhs: torch.Tensor) -> torch.Tensor:
    """(gram + alpha I)^-1 rhs for a Gram matrix by Cholesky (the matrix is positive definite for alpha > 0).

    The factorisation's status is never read on the host (that would stall the device every refit): should rounding
    make it fail, the solution is NaN, so the probe predicts NaN and its rows fall back to the bootstrap baseline."""
    gram.diagonal().add_(alpha)  # in place: the Gram matrix is a temporary of the caller
    factor, info = torch.linalg.cholesky_ex(gram)
    solution = torch.cholesky_solve(rhs.unsqueeze(1), factor).squeeze(1)
    return torch.where(info == 0, solution, torch.full_like(solution, float("nan")))


class ValueProbe:
    """A sklearn-like ridge probe on torch tensors.

    With `pca_dims=None, clip=None` it reproduces `make_pipeline(StandardScaler(), Ridge(alpha))`.

    Args:
        alpha: ridge penalty.
        pca_dims: None (no PCA), an int (PCA of all columns), or (start, stop, k) blocks: columns [start, stop)
            (negative: counted from the end) are replaced by their top-k principal components; others pass through.
            k is capped by the number of rows and columns available at fit time (`fitted_pca_dims` records it).
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
        self._pca_blocks: list[tuple[int, int]] = []  # the fitted PCA blocks' columns, on the host: no device sync

    @property
    def is_fitted(self) -> bool:
        return "coef" in self._state

    def _blocks(self, n_features: int) -> list[PCABlock]:
        if self.pca_dims is None:
            return []
        if isinstance(self.pca_dims, int):
            return [(0, n_features, self.pca_dims)] if self.pca_dims > 0 else []

        def column(c) -> int:  # negative counts from the end, as in a slice: (0, -1, k) leaves the last column out
            return int(c) + n_features if int(c) < 0 else int(c)

        blocks = sorted((column(a), column(b), int(k)) for a, b, k in self.pca_dims if k > 0)
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
        for i, (start, stop) in enumerate(self._pca_blocks):
            parts += [z[:, cursor:start], z[:, start:stop] @ s[f"pca_components_{i}"].T]
            cursor = stop
        parts.append(z[:, cursor:])
        return torch.cat(parts, dim=1)

    def fit(self, x: torch.Tensor, y: torch.Tensor, check_finite: bool = True) -> "ValueProbe":
        """Fit on (N, D) features and (N,) targets; rows must be finite. `check_finite=False` skips the check, which
        reads a flag on the host, for callers that filtered the rows already (the estimator's buffer)."""
        if x.ndim != 2 or y.shape != (x.size(0),):
            raise ValueError(f"fit expects X (N, D) and y (N,), got {tuple(x.shape)} and {tuple(y.shape)}.")
        if x.size(0) < 2:
            raise ValueError(f"fit needs at least 2 examples, got {x.size(0)}.")
        if check_finite and not (torch.isfinite(x).all() and torch.isfinite(y).all()):
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
        self._pca_blocks = [(start, stop) for start, stop, _ in blocks]
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
        if centered.size(1) <= n:  # primal: (F'F + aI) w = F'y
            coef = _solve_spd(centered.T @ centered, self.alpha, centered.T @ yc)
        else:  # dual: w = F'(FF' + aI)^-1 y, the cheaper solve when D > N
            coef = centered.T @ _solve_spd(centered @ centered.T, self.alpha, yc)
        self._state["coef"] = coef
        self._state["intercept"] = (target_mean - design_mean @ coef).reshape(1)
        if self.clip == "observed":
            self._state["clip"] = torch.stack([y64.min(), y64.max()])
        else:
            low, high = self.clip or (-torch.inf, torch.inf)
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

    def affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight (D,), bias 0-d), float64: scaler, PCA and ridge folded into one map, predict(x) = clip(x @ weight +
        bias). Linear in x, so the value of a mean of states is the mean of their projections (prefix.py)."""
        if not self.is_fitted:
            raise RuntimeError("ValueProbe.affine called before fit.")
        s = self._state
        weight, j, cursor = torch.empty_like(s["mean"]), 0, 0
        for i, (start, stop) in enumerate(self._pca_blocks):
            components = s[f"pca_components_{i}"]  # (k, stop - start): design column j + m is z_block @ row m
            weight[cursor:start] = s["coef"][j : j + start - cursor]
            j += start - cursor
            weight[start:stop] = components.T @ s["coef"][j : j + components.size(0)]
            j, cursor = j + components.size(0), stop
        weight[cursor:] = s["coef"][j:]
        weight = weight / s["scale"]
        return weight, s["intercept"][0] - weight @ s["mean"]

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

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ValueProbe":
        """Inverse of `config()` (JSON lists back to tuples)."""
        pca, clip = config["pca_dims"], config["clip"]
        pca = pca if pca is None or isinstance(pca, int) else [tuple(block) for block in pca]
        return cls(alpha=config["alpha"], pca_dims=pca, clip=tuple(clip) if isinstance(clip, list) else clip)

    def clone(self) -> "ValueProbe":
        """An unfitted probe with the same settings."""
        return ValueProbe(alpha=self.alpha, pca_dims=self.pca_dims, clip=self.clip)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().contiguous() for k, v in self._state.items()}

    def map_state(self, function) -> None:
        """Replace every fitted tensor by `function(tensor)` where it lives (e.g. a broadcast from rank 0), without
        the round trip through the host that `state_dict` makes."""
        self._state = {key: function(self._state[key]) for key in sorted(self._state)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._state = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in state.items()}
        starts, stops = state.get("pca_start", torch.zeros(0)).tolist(), state.get("pca_stop", torch.zeros(0)).tolist()
        self._pca_blocks = [(int(a), int(b)) for a, b in zip(starts, stops, strict=True)]


class ProbeBuffer:
    """A sliding buffer of (feature, target[, group]) examples; the oldest rows are evicted first.

    Features are (N, ...) with any fixed trailing shape: (N, D) for one feature vector per row, (N, C, D) for the
    trainer's rows, which hold one feature vector per candidate layer. `groups` (optional, int64) names the prompt
    each row came from, so cross-validation can keep a prompt's rows in one fold.

    Storage is a ring on the device of the first rows added (the accelerator in training), grown (doubling, up to
    `capacity`) as rows arrive, so a buffer that holds few rows (a rare domain) takes little memory: `add` never waits
    for the device, even when a mask decides which rows enter. Its write position and fill level then live on the
    device; `counts()` returns them and `set_counts` hands the host's copy back (the estimator fetches them in its
    one transfer per step); reading the rows, or growing after a masked add nobody counted, syncs by itself.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1.")
        self.capacity = capacity
        self._features: torch.Tensor | None = None  # (allocated + 1, ...): the last row takes the rows not kept
        self._targets: torch.Tensor | None = None
        self._groups: torch.Tensor | None = None
        self._position: torch.Tensor | None = None  # device [next write index, filled rows]
        self._host: tuple[int, int] | None = (0, 0)  # the same on the host; None while only the device knows

    def __len__(self) -> int:
        return self._host_counts()[1]

    def _host_counts(self) -> tuple[int, int]:
        if self._host is None:
            self.set_counts(*self._position.tolist())
        return self._host

    def counts(self) -> torch.Tensor:
        """Device [next write index, filled rows], for a caller that batches its host transfers."""
        return torch.zeros(2, dtype=torch.long) if self._position is None else self._position

    def set_counts(self, position: int, filled: int) -> None:
        self._host = (int(position), int(filled))

    @property
    def allocated(self) -> int:
        """Rows the ring has room for now (it grows to `capacity`)."""
        return 0 if self._targets is None else self._targets.numel() - 1

    def _grow(self, rows: int, features: torch.Tensor, with_groups: bool) -> None:
        """Room for `rows` rows (at most `capacity`), keeping the filled ones: until the ring is full it has never
        wrapped, so its rows sit at [0, filled)."""
        size = min(self.capacity, max(rows, 2 * self.allocated))
        device = features.device if self._features is None else self._features.device
        shape = features.shape[1:] if self._features is None else self._features.shape[1:]
        grown = {
            "_features": torch.zeros(size + 1, *shape, device=device),
            "_targets": torch.zeros(size + 1, device=device),
            "_groups": torch.zeros(size + 1, dtype=torch.long, device=device) if with_groups else None,
        }
        filled = 0 if self._features is None else self._host_counts()[1]
        for name, ring in grown.items():
            if ring is not None and filled:
                ring[:filled] = getattr(self, name)[:filled]
            setattr(self, name, ring)
        if self._position is None:
            self._position = torch.zeros(2, dtype=torch.long, device=device)

    def add(
        self,
        features: torch.Tensor,
        targets: torch.Tensor,
        groups: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> None:
        """Append the rows (those where `keep` is True) in order, keeping the newest `capacity`; stored in float32."""
        if self._features is not None and (groups is None) != (self._groups is None):
            raise ValueError("Give group ids with every batch added to a buffer, or with none.")
        if self._features is not None and features.shape[1:] != self._features.shape[1:]:
            raise ValueError(
                f"Feature width changed from {tuple(self._features.shape[1:])} to {tuple(features.shape[1:])}: "
                "the feature configuration (layers, features, model) must stay fixed for one buffer."
            )
        if self._features is None or (
            self.allocated < self.capacity and self._host_counts()[1] + targets.numel() > self.allocated
        ):
            self._grow(self._host_counts()[1] + targets.numel(), features, groups is not None)
        device = self._features.device
        features, targets = features.detach().to(device, torch.float32), targets.detach().to(device, torch.float32)
        known = keep is None and self._host is not None
        keep = torch.ones(targets.shape, dtype=torch.bool, device=device) if keep is None else keep.to(device)
        rank = keep.long().cumsum(0)  # 1-based rank of each kept row
        total = rank[-1] if rank.numel() else torch.zeros((), dtype=torch.long, device=device)
        write = keep & (total - rank < self.capacity)  # of more than `capacity` new rows, only the newest
        index = torch.where(write, (self._position[0] + rank - 1) % self.capacity, self.allocated)
        self._features.index_copy_(0, index, features)
        self._targets.index_copy_(0, index, targets)
        if groups is not None:
            self._groups.index_copy_(0, index, groups.detach().to(device, torch.long))
        self._position = torch.stack(
            [(self._position[0] + total) % self.capacity, (self._position[1] + total).clamp(max=self.capacity)]
        )
        if known:
            position, filled = self._host
            n = targets.numel()
            self._host = ((position + n) % self.capacity, min(filled + n, self.capacity))
        else:
            self._host = None

    def _ordered(self, ring: torch.Tensor | None) -> torch.Tensor | None:
        """The filled rows, oldest first: the same order whatever the ring's history, so fits are reproducible."""
        if ring is None:
            return None
        position, filled = self._host_counts()
        if filled < self.capacity:
            return ring[:filled]
        return torch.cat([ring[position : self.capacity], ring[:position]])

    @property
    def features(self) -> torch.Tensor | None:
        return self._ordered(self._features)

    @property
    def targets(self) -> torch.Tensor | None:
        return self._ordered(self._targets)

    @property
    def groups(self) -> torch.Tensor | None:
        return self._ordered(self._groups)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The rows oldest first, on the CPU (the layout of every earlier release)."""
        if self._features is None or len(self) == 0:
            return {}
        state = {"features": self.features, "targets": self.targets}
        if self._groups is not None:
            state["groups"] = self.groups
        return {k: v.detach().cpu().contiguous() for k, v in state.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], device: torch.device | str | None = None) -> None:
        self._features = self._targets = self._groups = self._position = None
        self._host = (0, 0)
        if state.get("targets") is not None and state["targets"].numel():
            moved = {k: v if device is None else v.to(device) for k, v in state.items()}
            self.add(moved["features"], moved["targets"], moved.get("groups"))


def prompt_group_ids(prompts: list) -> torch.Tensor:
    """A stable 63-bit id per prompt (the same on every rank and every run), so K-fold splits can group by prompt.

    Values JSON cannot write (images) count by type only: two prompts that differ only there share a group, which
    errs on the safe side for cross-validation, whereas an object's address would split one prompt's rollouts."""
    ids = []
    for prompt in prompts:
        text = json.dumps(prompt, sort_keys=True, default=lambda value: type(value).__name__).encode()
        ids.append(int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big", signed=True))
    return torch.tensor(ids, dtype=torch.long)


def grouped_kfold_errors(
    template: ValueProbe,
    features: torch.Tensor,
    targets: torch.Tensor,
    groups: torch.Tensor | None,
    folds: int,
) -> torch.Tensor | None:
    """Held-out absolute errors of probes configured like `template`, one probe per feature slice.

    `features` is (N, C, D): each of the C slices (one per candidate layer) gets its own K-fold cross-validation.
    Folds are drawn by group (prompt), so two rollouts of one prompt, or one prompt seen at two steps, never sit on
    both sides of a split. Returns (C, N) errors, each row predicted by the probe that did not see its group, or
    None when there are fewer than `folds` groups or a training fold would hold fewer than 2 rows.
    """
    # The fold of each row is decided on the host from one read of the group ids; the fits then index the device
    # tensors with index tensors, never boolean masks, so the K x C fits add no further transfer.
    group_ids = list(range(targets.numel())) if groups is None else groups.tolist()
    rank = {g: i for i, g in enumerate(sorted(set(group_ids)))}  # group ids are prompt hashes: sorted is a shuffle
    if folds < 2 or len(rank) < folds:
        return None
    fold = [rank[g] % folds for g in group_ids]
    if any(sum(f != k for f in fold) < 2 for k in range(folds)):
        return None
    device = features.device
    errors = torch.empty(features.size(1), targets.numel(), dtype=torch.float64, device=device)
    for k in range(folds):
        train = torch.tensor([i for i, f in enumerate(fold) if f != k], device=device)
        test = torch.tensor([i for i, f in enumerate(fold) if f == k], device=device)
        for c in range(features.size(1)):
            probe = template.clone().fit(features[train, c], targets[train], check_finite=False)  # buffered: finite
            errors[c, test] = (probe.predict(features[test, c]).double() - targets[test].double()).abs()
    return errors


def choose_layer(mae: Sequence[float], current: int, margin: float) -> int:
    """Index of the lowest held-out MAE, with hysteresis: leave `current` only for a relative gain above `margin`."""
    best = min(range(len(mae)), key=mae.__getitem__)
    return best if mae[best] < (1 - margin) * mae[current] else current


class OnlineProbe:
    """One online value probe: a `ValueProbe`, its sliding `ProbeBuffer` and its step counter.

    The trainer keeps one per domain (a single one without `probe_domain_column`). Buffered rows hold the features of
    every candidate layer, (N, C, D) with C = 1 for a fixed layer; the probe is fitted on one slice, `layer_index` (an
    index along C, not a layer id), and always predicts from the slice it was fitted on.

    Args:
        probe: the unfitted probe (its alpha, PCA and clip settings are reused for every refit).
        capacity: buffer size in rows.
        warmup_steps: steps of data before the probe is trusted (the bootstrap baseline until then).
    """

    def __init__(self, probe: ValueProbe, capacity: int, warmup_steps: int = 0):
        self.probe = probe
        self.buffer = ProbeBuffer(capacity)
        self.warmup_steps = warmup_steps
        self.steps = 0  # steps whose rows entered the buffer
        self.layer_index = 0
        self.warm_started = False  # loaded from a probe file: trusted at once
        self.refit_from_step = 0  # a warm start without buffer keeps its loaded fit until this many steps

    @property
    def trusted(self) -> bool:
        """Whether the baseline may use this probe: fitted, and past its bootstrap (or warm-started)."""
        return self.probe.is_fitted and (self.warm_started or self.steps >= self.warmup_steps)

    @property
    def can_fit(self) -> bool:
        return len(self.buffer) >= 2 and self.steps >= self.refit_from_step

    def add(
        self,
        features: torch.Tensor,
        targets: torch.Tensor,
        groups: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> None:
        """Append one step's rows (those where `keep` is True; possibly none) and count the step."""
        self.buffer.add(features, targets, groups, keep)
        self.steps += 1

    def fit(self, layer_index: int = 0, device: torch.device | str | None = None) -> "OnlineProbe":
        """Refit on the whole buffer (finite rows only ever enter it), on feature slice `layer_index`."""
        features, targets = self.buffer.features, self.buffer.targets
        self.probe.fit(features[:, layer_index].to(device), targets.to(device), check_finite=False)
        self.layer_index = layer_index
        return self

    def predict(self, features: torch.Tensor, return_unclipped: bool = False):
        """Predictions for (N, C, D) rows, from the slice the probe was fitted on."""
        return self.probe.predict(features[:, self.layer_index], return_unclipped=return_unclipped)

    def layer_errors(self, folds: int, device: torch.device | str | None = None) -> torch.Tensor | None:
        """(C, N) prompt-grouped K-fold absolute errors of each feature slice on the buffer (see
        `grouped_kfold_errors`); None with too few prompts."""
        if len(self.buffer) < 2:
            return None
        return grouped_kfold_errors(
            self.probe, self.buffer.features.to(device), self.buffer.targets.to(device), self.buffer.groups, folds
        )

    def state_dict(self, include_buffer: bool = True) -> dict[str, torch.Tensor]:
        state = {f"probe.{k}": v for k, v in self.probe.state_dict().items()}
        if include_buffer:
            state.update({f"buffer.{k}": v for k, v in self.buffer.state_dict().items()})
        return state

    def info(self, include_buffer: bool = True) -> dict[str, Any]:
        return {
            "probe": self.probe.config(),
            "buffer_capacity": self.buffer.capacity if include_buffer else None,
            "steps": self.steps,
            "layer_index": self.layer_index,
            "warm_started": self.warm_started,
            "refit_from_step": self.refit_from_step,
        }

    def load_state(
        self, state: dict[str, torch.Tensor], info: dict[str, Any], device: torch.device | str | None = None
    ) -> None:
        """Restore the fit, buffer and counters from `state_dict`/`info`. This object's probe settings (alpha, PCA,
        clip) are kept, and govern every later refit; the loaded fit predicts as saved. This object's capacity is
        kept too: the newest buffered rows survive."""
        self.probe.load_state_dict({k[len("probe.") :]: v for k, v in state.items() if k.startswith("probe.")})
        buffer = {k[len("buffer.") :]: v for k, v in state.items() if k.startswith("buffer.")}
        self.buffer = ProbeBuffer(self.buffer.capacity)
        self.buffer.load_state_dict(buffer, device)
        # "layer" in files before poise-trl 0.2 (the same candidate index under a name that read as a layer id)
        self.steps, self.layer_index = int(info["steps"]), int(info.get("layer_index", info.get("layer", 0)))
        self.warm_started, self.refit_from_step = bool(info["warm_started"]), int(info["refit_from_step"])
