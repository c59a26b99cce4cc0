"""The sliding buffer of (feature, target, prompt) rows an online value head learns from, and the prompt ids that
name its rows' groups. Pure torch."""

import hashlib
import json

import torch


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
