"""Cross-rollout baselines, leave-one-out targets and the paper's App. C diagnostics. Pure torch.

Rollouts come in consecutive groups of G (TRL's layout). Every function here takes an optional `valid` mask:
an invalid rollout is never used as somebody else's partner, so a NaN never crosses into another row.
"""

import math

import torch


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

    It is also the RLOO baseline used during the probe's bootstrap phase. NaN where no scorable partner exists.
    """
    return _mean_of_others(rewards, num_generations, valid)


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    denominator = (a.norm() * b.norm()).item()
    return float("nan") if denominator == 0 else (a @ b).item() / denominator


def baseline_diagnostics(
    rewards: torch.Tensor,
    baselines: torch.Tensor,
    values: torch.Tensor,
    num_generations: int,
    valid: torch.Tensor | None = None,
    unclipped_values: torch.Tensor | None = None,
) -> dict[str, float]:
    """Per-step value-estimation diagnostics over the rows that received a baseline.

    Keys: reward_mean, value_mean (mean probe prediction), baseline_mean, mae (|b - r|), group_mae (paper Fig. 4:
    |mean value - mean reward| per prompt), pearson_r (b vs r), brier_skill (1 - MSE(b, r)/Var(r)),
    variance_reduction (1 - Var(A)/Var(R)), sign_accuracy (within groups whose rewards differ, the fraction of
    pairs the values order like the rewards), clip_fraction (predictions the reward-range clip changed).
    Undefined quantities (e.g. zero variance) are NaN, which TRL's
    logger drops.
    """
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    valid = valid & torch.isfinite(rewards) & torch.isfinite(baselines)
    r, b = rewards[valid].double(), baselines[valid].double()
    nan = float("nan")
    out = {"reward_mean": nan, "value_mean": nan, "baseline_mean": nan, "mae": nan, "group_mae": nan}
    out.update({"pearson_r": nan, "brier_skill": nan, "variance_reduction": nan, "sign_accuracy": nan})
    out["clip_fraction"] = nan
    predicted = torch.isfinite(values)
    if predicted.any():
        out["value_mean"] = values[predicted].double().mean().item()
        if unclipped_values is not None:
            out["clip_fraction"] = (values[predicted] != unclipped_values[predicted]).double().mean().item()
    if r.numel() == 0:
        return out
    advantages = r - b
    var_r = r.var(unbiased=False).item()
    out.update(reward_mean=r.mean().item(), baseline_mean=b.mean().item(), mae=advantages.abs().mean().item())
    out["pearson_r"] = _pearson(b, r) if r.numel() > 1 else nan
    if var_r > 0:
        out["brier_skill"] = 1 - advantages.pow(2).mean().item() / var_r
        out["variance_reduction"] = 1 - advantages.var(unbiased=False).item() / var_r

    grouped_valid = valid.view(-1, num_generations)
    full = grouped_valid.all(1) & torch.isfinite(values).view(-1, num_generations).all(1)
    if full.any():
        group_r = rewards.view(-1, num_generations)[full].double()
        group_v = values.view(-1, num_generations)[full].double()
        out["group_mae"] = (group_v.mean(1) - group_r.mean(1)).abs().mean().item()
        i, j = torch.triu_indices(num_generations, num_generations, offset=1)
        reward_sign = torch.sign(group_r[:, i] - group_r[:, j])
        value_sign = torch.sign(group_v[:, i] - group_v[:, j])
        decided = reward_sign != 0
        if decided.any():
            out["sign_accuracy"] = (reward_sign[decided] == value_sign[decided]).double().mean().item()
    return out


def poise_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    num_generations: int,
    feature_ok: torch.Tensor,
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
    probe = cross_rollout_baselines(values, num_generations, feature_ok)
    baselines = torch.where(trusted.bool() & ~torch.isnan(probe), probe, rloo)
    receives = scorable & has_completion.bool() & torch.isfinite(baselines)
    advantages = torch.where(receives, rewards - baselines, torch.zeros_like(rewards))
    return advantages, baselines, receives


class RunningStd:
    """Sample std of every finite value seen so far, merged batch by batch (Chan et al.) in float64.

    `scale_rewards="batch"` divides step t's advantages by the std of the rewards of steps < t: a constant given the
    past, so, unlike the current batch's std, which contains each rollout's own reward, it cannot bias the gradient.
    Plain Python floats, so every rank computes the same value and a checkpoint restores it exactly.
    """

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: torch.Tensor) -> None:
        """Add the finite entries of `values`."""
        values = values[torch.isfinite(values)].double()
        n = values.numel()
        if n == 0:
            return
        mean = values.mean().item()
        m2 = (values - mean).pow(2).sum().item()
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        """Sample (n - 1) std, as TRL's batch std; NaN before two values."""
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else float("nan")

    def divisor(self, eps: float = 1e-4) -> float:
        """`std + eps` (TRL's batch scale), or 1 while the values seen so far have no spread above `eps` (at the
        first step, for instance), so that a missing scale never multiplies the advantages by 1/eps."""
        std = self.std
        return std + eps if std > eps else 1.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def append_reward_column(features: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """[φ_j, r_j]: the partner-aware probe's input, the rollout's own reward as one more (last) column.

    `features` is (N, D) or (N, C, D) (one vector per candidate layer); every slice gets the same reward column. The
    probe h(φ_j, r_j) only ever serves as the baseline of j's partners, so using r_j keeps their gradient unbiased.
    """
    if rewards.shape != features.shape[:1]:
        raise ValueError(f"Got {rewards.shape[0]} rewards for {features.shape[0]} feature rows.")
    column = rewards.to(features.dtype).view(-1, *([1] * (features.ndim - 1)))
    return torch.cat([features, column.expand(*features.shape[:-1], 1)], dim=-1)


def shrunk_rloo_fit(partner_means: torch.Tensor, rewards: torch.Tensor) -> tuple[float, float]:
    """(a, w) of the least-squares line r_i ≈ a + w * m_i over the finite pairs (m_i = mean reward of i's partners).

    The shrunk bootstrap uses a + w * m_i as baseline: with (a, w) fitted on earlier steps only it is a fixed
    function of the partners' rewards, hence unbiased. With no pairs: a=0, w=1 (plain RLOO); when every m_i is the
    same: w=0 and a = the mean reward.
    """
    keep = torch.isfinite(partner_means) & torch.isfinite(rewards)
    m, r = partner_means[keep].double(), rewards[keep].double()
    if m.numel() == 0:
        return 0.0, 1.0
    variance = (m - m.mean()).pow(2).mean()
    if variance <= 1e-12:
        return r.mean().item(), 0.0
    weight = ((m - m.mean()) * (r - r.mean())).mean() / variance
    return (r.mean() - weight * m.mean()).item(), weight.item()
