"""Which decoder layer the probe reads (`probe_layer="auto"`): prompt-grouped K-fold error of each candidate layer's
features on the buffered rows, with hysteresis. Pure torch."""

from collections.abc import Callable, Sequence

import torch

from ..heads.interface import ValueHead


def grouped_kfold_errors(
    template: ValueHead,
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


def select_layer(
    learners: Sequence,
    layers: Sequence[int],
    current: int,
    margin: float,
    folds: int,
    device: torch.device | str | None = None,
    broadcast: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[int, dict[str, float]]:
    """(slice to use, `layer_mae/<layer>` metrics): the candidate layer with the lowest prompt-grouped K-fold MAE over
    every learner's buffer (`OnlineLearner.layer_errors`), leaving `current` only when the best beats it by `margin`
    (relative). With too few prompts buffered to cross-validate: (current, {})."""
    errors = [learner.layer_errors(folds, device) for learner in learners]
    errors = [e for e in errors if e is not None]
    if not errors:
        return current, {}
    mae = torch.cat(errors, dim=1).mean(1)
    if broadcast is not None:  # every rank must hook and fit the same layer: rank 0's errors decide
        mae = broadcast(mae)
    host = mae.tolist()
    return choose_layer(host, current, margin), {
        f"layer_mae/{layer}": v for layer, v in zip(layers, host, strict=True)
    }
