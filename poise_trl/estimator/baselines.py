"""Cross-rollout baselines, leave-one-out targets and the paper's App. C diagnostics. Pure torch.

Rollouts come in consecutive groups of G (TRL's layout). Every function here takes an optional `valid` mask:
an invalid rollout is never used as somebody else's partner, so a NaN never crosses into another row.
"""

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch


def check_num_generations(num_generations: Any) -> None:
    """G, the rollouts per prompt: the cross-rollout baseline needs a partner."""
    if not isinstance(num_generations, int) or isinstance(num_generations, bool) or num_generations < 2:
        raise ValueError(
            f"num_generations={num_generations!r} is too small: POISE's cross-rollout baseline needs at least 2 "
            "rollouts per prompt. Set num_generations=2 (the paper's value) or more."
        )


def _mean_of_others(values: torch.Tensor, num_generations: int, valid: torch.Tensor | None) -> torch.Tensor:
    """For each row, the mean of the valid other rows of its group; NaN where the group has no valid other row."""
    if num_generations < 2:
        raise ValueError(f"num_generations={num_generations}: cross-rollout quantities need groups of at least 2.")
    if values.ndim != 1 or values.numel() % num_generations:
        raise ValueError(
            f"Got {values.numel()} rollouts, which do not form whole groups of {num_generations}: the batch must "
            "hold complete groups (generation batch size divisible by num_generations)."
        )
    valid = torch.isfinite(values) if valid is None else valid.bool() & torch.isfinite(values)
    grouped = torch.where(valid, values, torch.zeros_like(values)).view(-1, 1, num_generations)
    # others[g, i, j] selects j != i among valid rows: summing only the others (never "total - own") keeps b_i
    # bit-for-bit independent of row i and cannot overflow through a huge own value.
    others = valid.view(-1, 1, num_generations) & ~torch.eye(num_generations, dtype=torch.bool, device=values.device)
    count = others.sum(-1)
    mean = torch.where(others, grouped, torch.zeros_like(grouped)).sum(-1) / count.clamp(min=1)
    return torch.where(count > 0, mean, torch.full_like(mean, float("nan"))).view(-1)


def cross_rollout_baselines(
    values: torch.Tensor, num_generations: int, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """b_i = mean over valid j != i in i's group of values_j, e.g. g_f(φ_j): for G=2 the swap b¹=g(φ²), b²=g(φ¹).

    b_i never depends on rollout i, which keeps the policy gradient unbiased (paper §2.2). NaN where no partner.
    """
    return _mean_of_others(values, num_generations, valid)


def leave_one_out_targets(
    rewards: torch.Tensor, num_generations: int, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Probe target for φ_i: the mean reward of the other rollouts of the same prompt (partner's reward for G=2).

    It is also the RLOO baseline: the paper's bootstrap (`probe_bootstrap='rloo'`) and the input of the shrunk one.
    NaN where no scorable partner exists.
    """
    return _mean_of_others(rewards, num_generations, valid)


DIAGNOSTICS = (
    "reward_mean",
    "value_mean",
    "baseline_mean",
    "mae",
    "group_mae",
    "pearson_r",
    "brier_skill",
    "variance_reduction",
    "variance_reduction_bound",
    "sign_accuracy",
    "clip_fraction",
)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over `mask` in float64, NaN over an empty mask; no data-dependent shapes, so no device sync."""
    return torch.where(mask, values.double(), 0.0).sum() / mask.sum()


def diagnostic_tensors(
    rewards: torch.Tensor,
    baselines: torch.Tensor,
    values: torch.Tensor,
    num_generations: int,
    valid: torch.Tensor | None = None,
    unclipped_values: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-step value-estimation diagnostics over the rows that received a baseline, as one float64 tensor in
    `DIAGNOSTICS` order, computed on the device without a sync.

    Entries: reward_mean, value_mean (mean probe prediction), baseline_mean, mae (|b - r|), group_mae (paper Fig. 4:
    |mean value - mean reward| per prompt), pearson_r (b vs r), brier_skill (1 - MSE(b, r)/Var(r)),
    variance_reduction (1 - Var(A)/Var(R)), variance_reduction_bound (that of the best unbiased baseline, the prompt's
    value V(x): 1 - mean within-group reward variance / Var(R), from the groups' sample variances, so noisy and
    possibly negative on one small batch), sign_accuracy (within groups whose rewards differ, the fraction of
    pairs the values order like the rewards), clip_fraction (predictions the reward-range clip changed).
    Undefined quantities (e.g. zero variance) are NaN; `POISETrainer` leaves them out of that step's log.
    """
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    valid = valid & torch.isfinite(rewards) & torch.isfinite(baselines)
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=rewards.device)
    r, b = torch.where(valid, rewards.double(), 0.0), torch.where(valid, baselines.double(), 0.0)
    count = valid.sum()
    predicted = torch.isfinite(values)
    clip_fraction = nan
    if unclipped_values is not None:
        clip_fraction = _masked_mean((values != unclipped_values).double(), predicted)
    reward_mean, baseline_mean = r.sum() / count, b.sum() / count
    advantages = torch.where(valid, r - b, 0.0)
    mae = advantages.abs().sum() / count
    rc, bc = torch.where(valid, r - reward_mean, 0.0), torch.where(valid, b - baseline_mean, 0.0)
    var_r = rc.pow(2).sum() / count
    denominator = rc.norm() * bc.norm()
    pearson = torch.where((denominator > 0) & (count > 1), (rc * bc).sum() / denominator, nan)
    advantage_var = torch.where(valid, advantages - advantages.sum() / count, 0.0).pow(2).sum() / count
    spread = var_r > 0
    brier = torch.where(spread, 1 - advantages.pow(2).sum() / count / var_r, nan)
    variance_reduction = torch.where(spread, 1 - advantage_var / var_r, nan)
    # The best unbiased baseline is the prompt's value V(x): its advantage variance is the mean within-prompt reward
    # variance, estimated without bias by each group's sample variance (n - 1); no baseline can reduce more.
    in_group = valid.view(-1, num_generations)
    sizes = in_group.sum(1)
    grouped = r.view(-1, num_generations)
    centred = torch.where(in_group, grouped - grouped.sum(1, keepdim=True) / sizes.clamp(min=1)[:, None], 0.0)
    within = _masked_mean(centred.pow(2).sum(1) / (sizes - 1).clamp(min=1), sizes >= 2)
    variance_reduction_bound = torch.where(spread, 1 - within / var_r, nan)

    full = valid.view(-1, num_generations).all(1) & predicted.view(-1, num_generations).all(1)
    group_r = torch.where(full[:, None], rewards.view(-1, num_generations).double(), 0.0)
    group_v = torch.where(full[:, None], values.view(-1, num_generations).double(), 0.0)
    group_mae = _masked_mean((group_v.mean(1) - group_r.mean(1)).abs(), full)
    i, j = torch.triu_indices(num_generations, num_generations, offset=1, device=rewards.device)
    reward_sign = torch.sign(group_r[:, i] - group_r[:, j])
    value_sign = torch.sign(group_v[:, i] - group_v[:, j])
    decided = (reward_sign != 0) & full[:, None]
    sign_accuracy = _masked_mean((reward_sign == value_sign).double(), decided)
    out = [
        reward_mean,
        _masked_mean(values, predicted),
        baseline_mean,
        mae,
        group_mae,
        pearson,
        brier,
        variance_reduction,
        variance_reduction_bound,
        sign_accuracy,
        clip_fraction,
    ]
    return torch.stack([v.double() for v in out])


def step_statistics(
    rewards: torch.Tensor,
    num_generations: int,
    baselines: torch.Tensor,
    values: torch.Tensor,
    unclipped: torch.Tensor,
    receives: torch.Tensor,
    extra: Mapping[str, torch.Tensor],
    domain_rows: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[str]]:
    """A step's diagnostics of the sequence-level baseline as one float64 tensor and its names, for the one host
    transfer: `DIAGNOSTICS` over every row, then `extra`'s 0-d tensors, then `DIAGNOSTICS` per domain of
    `domain_rows` (name -> (N,) bool; None: no per-domain diagnostics)."""
    stats = [diagnostic_tensors(rewards, baselines, values, num_generations, receives, unclipped)]
    stats.append(torch.stack([v.double().reshape(()) for v in extra.values()]))
    names = [*DIAGNOSTICS, *extra]
    for name, rows in (domain_rows or {}).items():
        stats.append(diagnostic_tensors(rewards, baselines, values, num_generations, receives & rows, unclipped))
        names += [f"domain/{name}/{key}" for key in DIAGNOSTICS]
    return torch.cat(stats), names


def poise_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    num_generations: int,
    usable: torch.Tensor,
    has_completion: torch.Tensor,
    trusted: torch.Tensor,
    fallback: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """POISE's advantage rule on a gathered batch: (advantages, baselines, receives).

    A row whose probe is `trusted` gets the cross-rollout baseline from its partners' probe values (partners with
    usable features only); otherwise, or when no partner has usable features, the RLOO mean of the partners'
    rewards. Both are independent of the row itself, so the gradient stays unbiased. Rows with a non-finite reward,
    no completion, or no baseline at all `receive` nothing: advantage 0, never NaN. `fallback` replaces the RLOO
    baseline (e.g. the shrunk bootstrap, a + w * RLOO); it must not depend on the row's own rollout either.
    """
    scorable = torch.isfinite(rewards)
    rloo = leave_one_out_targets(rewards, num_generations, scorable) if fallback is None else fallback
    probe = cross_rollout_baselines(values, num_generations, usable)
    baselines = torch.where(trusted.bool() & ~torch.isnan(probe), probe, rloo)
    receives = scorable & has_completion.bool() & torch.isfinite(baselines)
    advantages = torch.where(receives, rewards - baselines, torch.zeros_like(rewards))
    return advantages, baselines, receives


def prefix_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    generated: torch.Tensor,
    receives: torch.Tensor,
    fallback: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token advantages A_t = r - V(x, y_<t): ((N, T) advantages, (N,) rows that got the prefix baseline).

    `values` (N, T) must come from a probe fitted on other rollouts and read states before each token only (prefix.py):
    a baseline of the prefix alone keeps the gradient unbiased, E[grad log pi(y_t | x, y_<t) V(x, y_<t)] = 0.
    Tokens the policy did not generate (`generated` False: padding, tool results, environment feedback) and rows
    that receive no advantage get 0. A generated token whose value is not finite gets the row's sequence-level
    advantage `fallback` (N,), that token alone: whether V(x, y_<t) is finite is read from the prefix too, so token t's
    baseline still never depends on y_t or later tokens (a row-wide switch would let a NaN at a later token change
    the earlier tokens' baselines), and a NaN never reaches the loss. The (N,) rows are those every generated token of
    which got the prefix baseline."""
    generated = generated.bool()
    finite = torch.isfinite(values)
    tokens = rewards.unsqueeze(1) - torch.where(finite, values, 0.0).to(rewards.dtype)
    tokens = torch.where(finite, tokens, fallback.unsqueeze(1).to(tokens.dtype))
    prefix = receives.bool() & torch.where(generated, finite, True).all(1)
    return torch.where(generated & receives.bool().unsqueeze(1), tokens, 0.0), prefix


class RunningStd:
    """Sample std of every finite value seen so far, merged batch by batch (Chan et al.) in float64.

    `scale_rewards="batch"` divides step t's advantages by the std of the rewards of steps < t: a constant given the
    past, so, unlike the current batch's std, which contains each rollout's own reward, it cannot bias the gradient.
    The state [count, mean, m2] is one float64 tensor on the rewards' device, so updates never wait for the device.
    """

    def __init__(self) -> None:
        self.state = torch.zeros(3, dtype=torch.float64)

    def updated(self, values: torch.Tensor) -> "RunningStd":
        """A new running std that has also seen the finite entries of `values`; this one is left as it is."""
        finite = torch.isfinite(values)
        state = self.state.to(values.device)
        n = finite.sum().double()
        mean = torch.where(finite, values.double(), 0.0).sum() / n.clamp(min=1)
        m2 = torch.where(finite, values.double() - mean, 0.0).pow(2).sum()
        count, running_mean, running_m2 = state
        total = count + n
        delta = mean - running_mean
        merged = torch.stack(
            [
                total,
                running_mean + delta * n / total.clamp(min=1),
                running_m2 + m2 + delta * delta * count * n / total.clamp(min=1),
            ]
        )
        running = RunningStd()
        running.state = torch.where(n > 0, merged, state)
        return running

    def update(self, values: torch.Tensor) -> None:
        """Add the finite entries of `values` (one assignment)."""
        self.state = self.updated(values).state

    @property
    def count(self) -> int:
        return int(self.state[0])

    @property
    def std(self) -> float:
        """Sample (n - 1) std, as TRL's batch std; NaN before two values."""
        count, _, m2 = self.state.tolist()
        return math.sqrt(m2 / (count - 1)) if count > 1 else float("nan")

    def divisor(self, eps: float = 1e-4) -> torch.Tensor:
        """`std + eps` (TRL's batch scale), or 1 while the values seen so far have no spread above `eps` (at the
        first step, for instance), so that a missing scale never multiplies the advantages by 1/eps. A 0-d tensor."""
        count, _, m2 = self.state
        std = (m2 / (count - 1).clamp(min=1)).sqrt()
        return torch.where((count > 1) & (std > eps), std + eps, torch.ones_like(std))

    def state_dict(self) -> dict[str, float]:
        count, mean, m2 = self.state.tolist()
        return {"count": int(count), "mean": mean, "m2": m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.state = torch.tensor(
            [float(state["count"]), float(state["mean"]), float(state["m2"])], dtype=torch.float64
        )


def shrunk_rloo_line(partner_means: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """[a, w] of the shrunk bootstrap's baseline a + w * m_i = (1 - w) * r̄ + w * m_i, RLOO's m_i (the mean reward of
    i's partners) shrunk towards r̄, the mean reward of the finite pairs, as a float64 tensor on the inputs' device,
    computed without a device sync.

    w is the least-squares weight over the pairs, min over w in [0, 1] of sum_i (r_i - r̄ - w * (m_i - r̄))^2: the
    unconstrained minimiser clamped to [0, 1], as the objective is a parabola in w. Being a convex mix of r̄ and m_i,
    the baseline lies between the pairs' mean reward and the partners' mean for every m_i, so within the rewards
    seen; a free intercept could leave that range (one group of G alone fits w = 1 - G, as m_i = (S - r_i) / (G - 1)
    falls as r_i rises). With (a, w) fitted on earlier steps only the baseline is a fixed function of the partners'
    rewards, hence unbiased. With no pairs: a=0, w=1 (plain RLOO); when every m_i equals r̄: w=0, a = r̄.
    """
    keep = torch.isfinite(partner_means) & torch.isfinite(rewards)
    n = keep.sum().double()
    r_mean = torch.where(keep, rewards.double(), 0.0).sum() / n.clamp(min=1)
    dm = torch.where(keep, partner_means.double() - r_mean, 0.0)
    dr = torch.where(keep, rewards.double() - r_mean, 0.0)
    # |sum dm * dr| <= sqrt(sum dm^2 * sum dr^2), so a zero denominator has a zero numerator: 0 / tiny = w 0
    weight = ((dm * dr).sum() / dm.pow(2).sum().clamp(min=torch.finfo(torch.float64).tiny)).clamp(0.0, 1.0)
    line = torch.stack([(1 - weight) * r_mean, weight])
    return torch.where(n > 0, line, torch.tensor([0.0, 1.0], dtype=torch.float64, device=line.device))


BOOTSTRAPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None] = {
    "rloo": None,
    "shrunk": shrunk_rloo_line,
}
"""`probe_bootstrap` -> the baseline of a row before its probe is trusted: a line [a, w] fitted on earlier steps'
(partner mean m_i, reward r_i) pairs, whose a + w * m_i is the baseline; None is the paper's RLOO, m_i itself, which
learns nothing and keeps no pairs. A new bootstrap is one entry: its line's fit, whose baseline must stay within the
rewards seen (w in [0, 1], a + w * m between the pairs' rewards and m)."""

REWARD_SCALINGS: dict[str, Callable[[RunningStd], torch.Tensor | None]] = {
    "none": lambda std: None,
    "batch": RunningStd.divisor,
}
"""`scale_rewards` -> the divisor of a step's advantages from the running std of earlier steps' rewards (None:
unscaled, the paper's). Never a std the step's own rewards enter ("group" is not an entry), which would bias the
gradient."""
