"""The sliding buffer of (feature, target, prompt) rows an online value head learns from, and the prompt ids that
name its rows' groups. Pure torch."""

import copy
import hashlib
import json
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Ring:
    """A buffer's rows and counters, replaced whole by every change (its tensors are never written once a buffer
    holds it). `features`/`targets`/`groups` have one row more than they hold (it takes the rows not kept);
    `position` is the device's [next write index, filled rows], `host` the same on the host (None while only the
    device knows)."""

    features: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    groups: torch.Tensor | None = None
    position: torch.Tensor | None = None
    host: tuple[int, int] | None = (0, 0)


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

    Every change builds a new `Ring` and assigns it once: `add` writes the step's rows into a copy of the ring
    (torch's out-of-place `index_copy`), so a stop midway leaves the buffer as it was, and `added` returns a new
    buffer, leaving this one as it is. The cost is a transient second ring while the rows are written (the ring's
    size: 4,096 rows x 5,123 float32 columns, 84 MB, per full buffer at Qwen3-4B's width and per candidate layer),
    freed once the old ring is dropped; a growing ring copies its rows into the new allocation anyway.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1.")
        self.capacity = capacity
        self._ring = Ring()

    def __len__(self) -> int:
        return self._host_counts()[1]

    def _host_counts(self) -> tuple[int, int]:
        if self._ring.host is None:
            self.set_counts(*self._ring.position.tolist())
        return self._ring.host

    def counts(self) -> torch.Tensor:
        """Device [next write index, filled rows], for a caller that batches its host transfers."""
        return torch.zeros(2, dtype=torch.long) if self._ring.position is None else self._ring.position

    @property
    def counts_known(self) -> bool:
        """Whether the host knows the counts (False after a masked `add`, until `set_counts` or a read)."""
        return self._ring.host is not None

    def set_counts(self, position: int, filled: int) -> None:
        self._ring = replace(self._ring, host=(int(position), int(filled)))

    @property
    def allocated(self) -> int:
        """Rows the ring has room for now (it grows to `capacity`)."""
        return 0 if self._ring.targets is None else self._ring.targets.numel() - 1

    def _grown(self, rows: int, features: torch.Tensor, with_groups: bool) -> Ring:
        """A new ring with room for `rows` rows (at most `capacity`), holding the filled ones: until the ring is full
        it has never wrapped, so its rows sit at [0, filled)."""
        ring = self._ring
        size = min(self.capacity, max(rows, 2 * self.allocated))
        device = features.device if ring.features is None else ring.features.device
        shape = features.shape[1:] if ring.features is None else ring.features.shape[1:]
        grown = {
            "features": torch.zeros(size + 1, *shape, device=device),
            "targets": torch.zeros(size + 1, device=device),
            "groups": torch.zeros(size + 1, dtype=torch.long, device=device) if with_groups else None,
        }
        filled = 0 if ring.features is None else self._host_counts()[1]
        for name, new in grown.items():
            if new is not None and filled:
                new[:filled] = getattr(ring, name)[:filled]
        position = torch.zeros(2, dtype=torch.long, device=device) if ring.position is None else ring.position
        return Ring(**grown, position=position, host=self._ring.host)

    def add(
        self,
        features: torch.Tensor,
        targets: torch.Tensor,
        groups: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> None:
        """Append the rows (those where `keep` is True) in order, keeping the newest `capacity`; stored in float32.
        The new ring is assigned once (class docstring)."""
        ring = self._ring
        if ring.features is not None and (groups is None) != (ring.groups is None):
            raise ValueError("Give group ids with every batch added to a buffer, or with none.")
        if ring.features is not None and features.shape[1:] != ring.features.shape[1:]:
            raise ValueError(
                f"Feature width changed from {tuple(ring.features.shape[1:])} to {tuple(features.shape[1:])}: "
                "the feature configuration (layers, features, model) must stay fixed for one buffer."
            )
        grow = ring.features is None or (
            self.allocated < self.capacity and self._host_counts()[1] + targets.numel() > self.allocated
        )
        # A freshly grown ring is this add's own, so its rows are written in place; the held one is copied.
        ring = (
            self._grown(self._host_counts()[1] + targets.numel(), features, groups is not None) if grow else self._ring
        )
        allocated = ring.targets.numel() - 1
        device = ring.features.device
        features, targets = features.detach().to(device, torch.float32), targets.detach().to(device, torch.float32)
        known = keep is None and ring.host is not None
        keep = torch.ones(targets.shape, dtype=torch.bool, device=device) if keep is None else keep.to(device)
        rank = keep.long().cumsum(0)  # 1-based rank of each kept row
        total = rank[-1] if rank.numel() else torch.zeros((), dtype=torch.long, device=device)
        write = keep & (total - rank < self.capacity)  # of more than `capacity` new rows, only the newest
        index = torch.where(write, (ring.position[0] + rank - 1) % self.capacity, allocated)

        def written(rows: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
            if rows is None:
                return None
            return rows.index_copy_(0, index, new) if grow else rows.index_copy(0, index, new)

        host = None
        if known:
            position, filled = ring.host
            n = targets.numel()
            host = ((position + n) % self.capacity, min(filled + n, self.capacity))
        self._ring = Ring(
            features=written(ring.features, features),
            targets=written(ring.targets, targets),
            groups=written(ring.groups, None if groups is None else groups.detach().to(device, torch.long)),
            position=torch.stack(
                [(ring.position[0] + total) % self.capacity, (ring.position[1] + total).clamp(max=self.capacity)]
            ),
            host=host,
        )

    def added(
        self,
        features: torch.Tensor,
        targets: torch.Tensor,
        groups: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> "ProbeBuffer":
        """A new buffer holding this one's rows and these (as `add`); this one is left as it is."""
        buffer = copy.copy(self)  # shares the ring, which `add` replaces rather than writes
        buffer.add(features, targets, groups, keep)
        return buffer

    def _ordered(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        """The filled rows, oldest first: the same order whatever the ring's history, so fits are reproducible."""
        if rows is None:
            return None
        position, filled = self._host_counts()
        if filled < self.capacity:
            return rows[:filled]
        return torch.cat([rows[position : self.capacity], rows[:position]])

    @property
    def features(self) -> torch.Tensor | None:
        return self._ordered(self._ring.features)

    @property
    def targets(self) -> torch.Tensor | None:
        return self._ordered(self._ring.targets)

    @property
    def groups(self) -> torch.Tensor | None:
        return self._ordered(self._ring.groups)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The rows oldest first, on the CPU (the layout of every earlier release)."""
        if self._ring.features is None or len(self) == 0:
            return {}
        state = {"features": self.features, "targets": self.targets}
        if self._ring.groups is not None:
            state["groups"] = self.groups
        return {k: v.detach().cpu().contiguous() for k, v in state.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], device: torch.device | str | None = None) -> None:
        """Restore `state_dict()` (onto `device`), in one assignment."""
        loaded = ProbeBuffer(self.capacity)
        if state.get("targets") is not None and state["targets"].numel():
            moved = {k: v if device is None else v.to(device) for k, v in state.items()}
            loaded.add(moved["features"], moved["targets"], moved.get("groups"))
        self._ring = loaded._ring


def prompt_group_ids(prompts: list) -> torch.Tensor:
    """A stable 63-bit id per prompt (the same on every rank and every run), so K-fold splits can group by prompt.

    Values JSON cannot write (images) count by type only: two prompts that differ only there share a group, which
    errs on the safe side for cross-validation, whereas an object's address would split one prompt's rollouts."""
    ids = []
    for prompt in prompts:
        text = json.dumps(prompt, sort_keys=True, default=lambda value: type(value).__name__).encode()
        ids.append(int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big", signed=True))
    return torch.tensor(ids, dtype=torch.long)
