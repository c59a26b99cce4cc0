"""One generation batch in `POISETrainer`, from prompt selection to the estimator's observation, as one record.
Pure torch.

TRL makes a generation batch across several methods a subclass sees one at a time (the prompts, `_generate`,
`_calculate_rewards`, a teacher-forced pass, then the loss's forward of every micro-batch). What POISE needs of them
is kept here: created when the batch is made, dropped once the estimator has observed it.

Where the features come from is the batch's capture route (`ROUTES`):
- "trl_pass": TRL's own no-grad old-log-prob pass, hooked while it scores the batch;
- "own_pass": a no-grad pass POISE runs itself after scoring, where TRL runs none and the loss cannot serve;
- "loss": the loss's own forward of each micro-batch, where TRL runs no pass: every micro-batch of the batch is then
  trained with the weights that generated it, so that forward sees the states a pass would. Each micro-batch holds
  whole groups, so its advantages follow from its own rows and the probe of earlier steps, written before TRL's loss
  reads them; the batch is observed once its last micro-batch has been captured.
"""

from dataclasses import dataclass, field
from typing import Any

import torch

from ..estimator.batch import Rollouts
from ..features.features import FeatureSpans
from ..features.prefix import PrefixBatch, PrefixCapture
from .contract import ContractError

ROUTES = ("trl_pass", "own_pass", "loss")
CAPTURES = ("auto", "pass")  # `probe_capture`: the loss's forward where TRL runs no pass, or always a pass
ROW_KEY = "poise_row"  # each row's index in this process's batch, in TRL's batch dict: a list of ints (host-side)


@dataclass
class GenerationStep:
    """One generation batch's state. `rows` rows of this process, global rows `offset`.. of the gathered batch.

    `rollouts` is the gathered batch record `POISEEstimator.advantages` reads besides the features (rewards,
    num_generations, domains, has_completion, weights, prompt_ids); `pieces` are the captured (this process's row
    indices, (b, C, D) features, the token capture) of each pass or micro-batch."""

    mode: str
    route: str
    regroup: bool = False  # TRL's micro-batches of it are regrouped into whole groups (`whole_groups`)
    armed: bool = False  # a pass route: the next teacher-forced pass of the policy is the one to capture
    weights: torch.Tensor | None = None  # (rows,) float64: this process's kept rows' importance weights
    selection: dict[str, float] = field(default_factory=dict)  # the prompt draw's host-side figures
    tool_mask: list | None = None  # TRL's per-row tool/environment mask (1: the policy wrote the token)
    rewards_per_func: torch.Tensor | None = None  # (N, reward functions), gathered
    spans: FeatureSpans | None = None  # this process's rows
    tokens: PrefixCapture | None = None  # the token capture over this process's rows (per-prefix baseline)
    rows: int = 0
    offset: int = 0
    rollouts: Rollouts | None = None
    pieces: list[tuple[torch.Tensor, torch.Tensor, PrefixBatch | None]] = field(default_factory=list)
    micro_batch: dict[str, Any] | None = None  # the loss route: the micro-batch whose forward is being captured

    def __post_init__(self):
        if self.route not in ROUTES:
            raise ValueError(f"route={self.route!r}: one of {ROUTES}.")

    def add(self, rows: torch.Tensor, features: torch.Tensor, prefix: PrefixBatch | None) -> None:
        """Keep one pass's or micro-batch's capture of this process's rows `rows`."""
        self.pieces.append((rows, features, prefix))

    @property
    def captured(self) -> int:
        return sum(rows.numel() for rows, _, _ in self.pieces)

    @property
    def complete(self) -> bool:
        return self.captured == self.rows

    def assemble(self) -> tuple[torch.Tensor, PrefixBatch | None]:
        """This process's (rows, C, D) features and token capture, in the batch's row order."""
        rows = torch.cat([rows for rows, _, _ in self.pieces])
        if not torch.equal(rows.sort().values, torch.arange(self.rows)):
            raise RuntimeError(f"Captured rows {rows.tolist()} are not each of the batch's {self.rows} rows once.")
        order = rows.argsort()
        features = torch.cat([f for _, f, _ in self.pieces])[order.to(self.pieces[0][1].device)]
        prefixes = [p for _, _, p in self.pieces]
        if prefixes[0] is None:
            return features, None
        return features, concat_prefix(prefixes, order)

    def rollouts_of(self, rows: torch.Tensor) -> Rollouts:
        """The batch record of this process's rows `rows` (ascending, whole groups), for the advantages of one
        micro-batch."""
        return self.rollouts.take(rows + self.offset)


def concat_prefix(parts: list[PrefixBatch], order: torch.Tensor) -> PrefixBatch:
    """The `PrefixBatch` of several captures' rows, concatenated and put in `order`."""

    def cat(name: str) -> torch.Tensor | None:
        tensors = [getattr(part, name) for part in parts]
        if tensors[0] is None:
            return None
        joined = torch.cat(tensors)
        return joined[order.to(joined.device)]

    return PrefixBatch(cat("rows"), cat("sampled"), cat("values"), cat("generated"), cat("tokens"))


def whole_groups(order: torch.Tensor, group_size: int) -> torch.Tensor:
    """Where to take the rows of a batch TRL shuffled (its row `i` being the batch's row `order[i]`) so that every
    group of `group_size` consecutive rows is whole again: each group goes where its first-drawn row went, its rows
    together and in order. The result is what shuffling whole groups by TRL's own draw gives, so the random stream
    stays GRPOTrainer's and no second draw is made; every micro-batch TRL splits off then holds whole groups."""
    rows = order.numel()
    first = torch.full((rows // group_size,), rows, dtype=torch.long)
    first.scatter_reduce_(0, order // group_size, torch.arange(rows), reduce="amin")
    permutation = (first.argsort().unsqueeze(1) * group_size + torch.arange(group_size)).flatten()
    return order.argsort()[permutation]


def join_rows(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One batch dict from several with the same keys, rows concatenated in order (tensors along dim 0, lists
    joined); a 0-d tensor (a batch-level scalar such as TRL's token count) and None are the same in every part."""

    def join(values: list[Any]) -> Any:
        first = values[0]
        if first is None or (isinstance(first, torch.Tensor) and first.ndim == 0):
            return first
        if isinstance(first, torch.Tensor):
            return torch.cat(values)
        return [item for value in values for item in value]

    return {key: join([part[key] for part in parts]) for key in parts[0]}


def take_rows(batch: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
    """`batch` with its rows taken at `index` (tensors and lists alike; 0-d tensors and None kept)."""

    def take(value: Any) -> Any:
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[index.to(value.device)]
        return [value[i] for i in index.tolist()]

    return {key: take(value) for key, value in batch.items()}


def check_whole_groups(rows: list[int], group_size: int) -> None:
    """Refuse a micro-batch whose rows (this process's row indices, any order) are not whole groups: on the loss
    route each micro-batch's advantages come from its own rows, so a group split across micro-batches would pair
    rollouts of different prompts. The rows are host-side integers (`ROW_KEY`): checking them reads no device."""
    groups = sorted({row // group_size for row in rows})
    if sorted(rows) != [group * group_size + k for group in groups for k in range(group_size)]:
        raise RuntimeError(
            f"A micro-batch reached the loss with rows {sorted(rows)}, which are not whole groups of {group_size} "
            "rollouts of one prompt: POISE's loss route reads each micro-batch's baselines from its own rows. Keep "
            "per_device_train_batch_size a multiple of num_generations, or set probe_capture='pass'."
        )


class MicroBatch(dict):
    """One micro-batch as TRL's loss receives it, tied to the record of its generation batch (`step`; None where the
    advantages were complete before TRL split the batch). On the loss route its advantages are written by its own
    forward: until then reading them raises instead of handing the loss the placeholder."""

    def __init__(self, rows: dict[str, Any], step: "GenerationStep | None"):
        super().__init__(rows)
        self.step = step
        self.written = step is None or step.route != "loss"

    def __getitem__(self, key: str) -> Any:
        if key == "advantages" and not self.written:
            raise ContractError(
                "loss_forward",
                "TRL's loss read a micro-batch's advantages before its forward gave them.",
                "Set probe_capture='pass'.",
            )
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default
