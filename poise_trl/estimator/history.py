"""Each prompt's own history: the count and mean reward of its rollouts at earlier steps, in a bounded table. Pure
torch.

SPO (arXiv 2509.13232) tracks every prompt's past rewards as its baseline. Here they are one more probe input: a
prompt's rewards from earlier steps are known before it is generated again and are independent of the rollouts they
serve, so a baseline that reads them stays unbiased, and they tell a settled prompt (always solved, always failed)
from a mixed one, which the hidden states alone do poorly. The estimator looks the step's prompts up before taking
its advantages and updates the table in `observe`, after them, so a step's rollouts never enter their own baseline.

The table holds at most `size` prompts, keyed by a stable 64-bit prompt id (the trainer's: `buffer.prompt_group_ids`,
a blake2b hash of the prompt, the same in every process and run; never Python's salted `hash()`). When a step brings
more prompts than free slots, the least recently seen prompts leave first (among those last seen at the same step,
the larger key leaves first: arbitrary, but the same everywhere). Every operation has a fixed shape and a fixed order
of additions (a sort, a segmented scan, gathers), so it never waits for the device and every process that updates
with the same gathered batch holds the same table, bit for bit, with no broadcast.
"""

import copy
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..settings import Refused

HISTORY_COLUMNS = ("seen", "log_count", "mean")  # the probe's input columns, in order
EMPTY = torch.iinfo(torch.long).max  # the key of an empty slot: sorted after every prompt, and its count is 0
SLOT_FIELDS = ("keys", "count", "weight", "total", "last")  # a slot: the prompt id, rewards seen, the decayed weight
# and reward sum of the mean, and the step it was last seen at


def segmented_sums(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """For (N,) `keys` sorted ascending, each row's sum of `values` over the rows of its key up to itself (inclusive):
    the last row of a key holds the key's total. A Hillis-Steele scan: log2(N) elementwise steps whose order of
    additions depends only on N, unlike a float `cumsum` or `scatter_add` on an accelerator."""
    n = keys.numel()
    position = torch.arange(n, device=keys.device)
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=keys.device), keys[1:] != keys[:-1]])
    start = torch.cummax(torch.where(starts, position, 0), 0).values  # first row of each row's key
    offset = 1
    while offset < n:  # each row adds the partial sum `offset` rows back when that row has its key
        values = values + torch.where(position - offset >= start, values.roll(offset), 0)
        offset *= 2
    return values


@dataclass(frozen=True)
class Learned:
    """What a history table learned: the observed steps so far (the step number a slot's `last` refers to) and the
    slots, sorted by key with the empty ones (key EMPTY, count 0) at the end, on the device of the first update
    (None before it). Replaced whole by every update, never written in place."""

    steps: int = 0
    slots: Mapping[str, torch.Tensor] | None = None


class PromptHistory:
    """A bounded table prompt id -> (count, mean reward) of the rewards observed at earlier steps.

    The mean is exponentially decayed per observed step: a prompt's rewards from k steps back weigh `decay`^k, so
    with decay 1 (the default) it is the plain mean of every earlier reward, and below 1 it follows a policy that
    changes. The count is the plain number of rewards seen, whatever the decay. Rows whose reward is not finite are
    skipped. What it learned is one `Learned` record, which `update` replaces in one assignment (`updated` returns a
    new table and leaves this one as it is).

    Args:
        size: slots; at most this many prompts are remembered (about 40 bytes each on the rewards' device).
        decay: per-step weight of older rewards in the mean, in (0, 1].
    """

    def __init__(self, size: int = 65536, decay: float = 1.0):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise Refused("size", size, "must be an int >= 1: the prompts the history table remembers.")
        if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 < decay <= 1:
            rule = "must be in (0, 1]: the weight of a reward one step older in the mean (1: plain)."
            raise Refused("decay", decay, rule)
        self.size = size
        self.decay = float(decay)
        self._learned = Learned()

    @property
    def steps(self) -> int:
        """Updates so far."""
        return self._learned.steps

    # ------------------------------------------------------------------------------------------------------ read
    def lookup(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(seen bool, count int64, mean float64) of each (N,) prompt id; 0 counts and means where unseen."""
        keys = keys.long()
        if self._learned.slots is None:
            zeros = torch.zeros_like(keys)
            return zeros.bool(), zeros, zeros.double()
        table = self._on(keys.device)
        index = torch.searchsorted(table["keys"], keys).clamp(max=self.size - 1)
        count = table["count"][index]
        seen = (table["keys"][index] == keys) & (count > 0)
        mean = table["total"][index] / table["weight"][index]  # an empty slot's 0 / 0 is masked below
        return seen, torch.where(seen, count, 0), torch.where(seen, mean, 0.0)

    def columns(self, keys: torch.Tensor) -> torch.Tensor:
        """(N, 3) float32 probe inputs of each prompt id, `HISTORY_COLUMNS`: seen (0/1), log(1 + count) and the mean
        reward (0 where unseen: the seen column lets a head learn the unseen prompts' level)."""
        seen, count, mean = self.lookup(keys)
        return torch.stack([seen.double(), torch.log1p(count.double()), mean], dim=1).float()

    # ----------------------------------------------------------------------------------------------------- learn
    def update(self, keys: torch.Tensor, rewards: torch.Tensor) -> None:
        """Add one step's (N,) rewards of (N,) prompt ids (a prompt may have several rows, in any order) and count
        the step, in one assignment. Call it only after the step's baselines were taken."""
        if keys.shape != rewards.shape:
            raise ValueError(f"Got {keys.numel()} prompt ids for {rewards.numel()} rewards.")
        device, step = rewards.device, self.steps
        if keys.numel() == 0:
            self._learned = replace(self._learned, steps=step + 1)
            return
        table = self._empty(self.size, device) if self._learned.slots is None else self._on(device)
        keys, order = torch.sort(keys.to(device).long(), stable=True)
        scorable = torch.isfinite(rewards)[order]
        count = segmented_sums(keys, scorable.long())
        total = segmented_sums(keys, torch.where(scorable, rewards[order].double(), 0.0))
        fresh = torch.cat([keys[1:] != keys[:-1], torch.ones(1, dtype=torch.bool, device=device)]) & (count > 0)
        # A prompt already in the table: its slot decays by the steps since it was last seen and takes this step's.
        index = torch.searchsorted(table["keys"], keys).clamp(max=self.size - 1)
        hit = fresh & (table["keys"][index] == keys) & (table["count"][index] > 0)
        factor = torch.pow(self.decay, (step - table["last"][index]).double())
        merged = {
            "keys": keys,
            "count": table["count"][index] + count,
            "weight": table["weight"][index] * factor + count,
            "total": table["total"][index] * factor + total,
            "last": torch.full_like(keys, step),
        }
        slot = torch.where(hit, index, self.size)  # every other row writes a spare slot, dropped below
        table = {  # new columns: the table held stays as it is
            name: torch.cat([table[name], table[name][:1]]).index_copy_(0, slot, column)[:-1]
            for name, column in merged.items()
        }
        # A new prompt competes for a slot; rows that are neither new nor scorable enter as empty ones.
        new = fresh & ~hit
        rows = {
            "keys": torch.where(new, keys, EMPTY),
            "count": torch.where(new, count, 0),
            "weight": torch.where(new, count.double(), 0.0),
            "total": torch.where(new, total, 0.0),
            "last": merged["last"],
        }
        slots = self._keep({name: torch.cat([table[name], rows[name]]) for name in SLOT_FIELDS})
        self._learned = Learned(step + 1, slots)

    def updated(self, keys: torch.Tensor, rewards: torch.Tensor) -> "PromptHistory":
        """A new table that has also seen this step (as `update`); this one is left as it is."""
        history = copy.copy(self)  # shares the record, which `update` replaces rather than writes
        history.update(keys, rewards)
        return history

    def _keep(self, candidates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The `size` entries to keep of `candidates` (the most recently seen; ties: the smaller key), sorted by key
        with the empty slots last."""
        order = torch.sort(candidates["keys"], stable=True).indices
        order = order[torch.sort(-candidates["last"][order], stable=True).indices]
        order = order[torch.sort((candidates["count"][order] == 0).long(), stable=True).indices][: self.size]
        order = order[torch.sort(candidates["keys"][order], stable=True).indices]
        kept = {name: column[order] for name, column in candidates.items()}
        if kept["keys"].numel() < self.size:  # fewer candidates than slots (a state loaded into a larger table)
            empty = self._empty(self.size - kept["keys"].numel(), kept["keys"].device)
            kept = {name: torch.cat([kept[name], empty[name]]) for name in kept}
        return kept

    @staticmethod
    def _empty(size: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        long = torch.zeros(size, dtype=torch.long, device=device)
        double = torch.zeros(size, dtype=torch.float64, device=device)
        return {"keys": long + EMPTY, "count": long, "weight": double, "total": double.clone(), "last": long.clone()}

    def _on(self, device: torch.device | str) -> Mapping[str, torch.Tensor]:
        """The slots on `device`: moved there once (e.g. after a load onto the CPU), a placement that leaves what
        was learned as it is."""
        slots = self._learned.slots
        if slots["keys"].device != torch.device(device):
            slots = {name: column.to(device) for name, column in slots.items()}
            self._learned = replace(self._learned, slots=slots)
        return slots

    # ---------------------------------------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The remembered prompts' slots, sorted by key, on the CPU (empty slots are not written)."""
        if self._learned.slots is None:
            return {}
        table = {name: column.cpu() for name, column in self._learned.slots.items()}
        used = table["count"] > 0
        return {name: column[used].contiguous() for name, column in table.items()}

    def info(self) -> dict[str, Any]:
        return {"size": self.size, "decay": self.decay, "steps": self.steps}

    def load_state_dict(
        self, state: dict[str, torch.Tensor], info: dict[str, Any], device: torch.device | str | None = None
    ) -> None:
        """Restore `state_dict`/`info` exactly, in one assignment (this object's size is kept: a smaller one keeps
        the most recently seen prompts)."""
        slots = None
        if state.get("keys") is not None and state["keys"].numel():
            slots = self._keep({name: state[name].to(device or "cpu") for name in SLOT_FIELDS})
        self._learned = Learned(int(info.get("steps", 0)), slots)
