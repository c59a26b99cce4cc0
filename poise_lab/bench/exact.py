"""Exact per-completion variance and bias of a policy-gradient rule, from U-statistics over a pool of rollouts.

The pool holds P prompts drawn i.i.d. from the prompt distribution, each with K i.i.d. rollouts (reward r_i, score
g_i = ∇ log π(y_i | x), given through the Gram matrix of the g_i). A rule draws a batch of n prompts with replacement
(or from a sampler q, with weights 1 / q) and G rollouts per prompt; its estimate is the mean over prompts of
Y / G = Σ_i A_i g_i / G. Then, for B = n G completions,

    B · tr Cov(ĝ) = G (E||Y/G||² − ||E Y/G||²),     bias² = ||E Y/G − g||²,   g = E_x E[r ∇ log π | x],

for every n, and each term has an unbiased estimate from the pool:

- E||Y/G||² given a prompt is the average over all G-subsets of its K rollouts (a U-statistic of order G), in closed
  form for binary rewards (the hypergeometric law of the other rollouts' successes), so no subset is enumerated;
- E Y/G given a prompt is c_x μ_x, μ_x = E[r g | x]: E[g | x] = 0 leaves of any advantage f(r_i, rest) only the
  slope d = f(1, rest) − f(0, rest), and d_{-i} (r_i − r̄_{-i}) g_i, averaged over i, is unbiased for it. A rule whose
  baseline never depends on the rollout it serves has d = 1 and shares the truth's estimate exactly: its bias² is
  zero to rounding;
- products of two expectations (||E Y/G||², E[Y/G]·g, ||g||²) are averages over pairs of distinct prompts.

No batch is drawn, no reference carries noise and nothing is centred. Bootstrap replicates reweight the prompts.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.stats import hypergeom

STD_EPS = 1e-4  # TRL's GRPO: (r - mean) / (std + 1e-4)


@dataclass(frozen=True)
class RuleMoments:
    """What the pool says about one rule, per prompt: `second` (P, K, K) weights whose Σ_ij second_ij g_i·g_j
    estimates E[||Y/G||² | x] (without a sampler); `mean` (P, K) weights whose Σ_i mean_i g_i estimates E[Y/G | x];
    `cost` completions per unit; `informative` (P,) P(group kept | x) when only informative groups enter the loss
    (DAPO), else None."""

    second: np.ndarray
    mean: np.ndarray
    cost: float
    informative: np.ndarray | None = None

    def padded(self, members: int) -> "RuleMoments":
        """The same rule on a per-prompt family of `members` vectors whose first K are the scores g_i (the per-prefix
        family [g; h]): zero weight on the rest."""
        extra = members - self.mean.shape[1]
        return RuleMoments(
            np.pad(self.second, ((0, 0), (0, extra), (0, extra))),
            np.pad(self.mean, ((0, 0), (0, extra))),
            self.cost,
            self.informative,
        )


def check_binary(rewards: np.ndarray) -> None:
    if not np.isin(rewards, (0.0, 1.0)).all():
        raise ValueError(
            "the exact group-rule moments need binary rewards (0 or 1); this pool has others: use a "
            "binary reward function"
        )


def truth_weights(rewards: np.ndarray) -> np.ndarray:
    """(P, K) weights of μ̂_x = mean_i (r_i − mean of the other rewards) g_i, unbiased for E[r ∇ log π | x]."""
    k = rewards.shape[1]
    others = (rewards.sum(1, keepdims=True) - rewards) / (k - 1)
    return (rewards - others) / k


def _advantage(r: np.ndarray, c: np.ndarray, group: int, scale: bool) -> np.ndarray:
    """A of a rollout with reward r whose group's other G − 1 rollouts hold c successes (binary rewards)."""
    t = r + c
    a = r - t / group
    if scale:
        a = a / (np.sqrt(np.clip(t * (group - t), 0, None) / (group * (group - 1))) + STD_EPS)
    return a


def _expect(
    fn: Callable[[np.ndarray], np.ndarray], total: np.ndarray, successes: np.ndarray, draws: int
) -> np.ndarray:
    """E fn(C), C ~ Hypergeometric(total, successes, draws), elementwise; impossible arguments give 0 (unused)."""
    total, successes = np.rint(total).astype(int), np.rint(successes).astype(int)
    valid = (successes >= 0) & (successes <= total)
    s = np.clip(successes, 0, total)
    c = np.arange(draws + 1).reshape((-1,) + (1,) * np.ndim(s))
    pmf = np.nan_to_num(hypergeom.pmf(c, total, s, draws))
    return np.where(valid, (pmf * fn(c)).sum(0), 0.0)


def group_moments(rewards: np.ndarray, group: int, scale: bool, informative_only: bool = False) -> RuleMoments:
    """GRPO's rule (advantage r − group mean, divided by the group's std + eps with `scale`) on G of K rollouts drawn
    without replacement; with `informative_only`, DAPO's dynamic sampling: groups whose rewards all agree are dropped
    and regenerated, so a kept group costs G / q completions, q = P(informative)."""
    check_binary(rewards)
    num_prompts, k = rewards.shape
    if group > k:
        raise ValueError(f"G={group} needs at least {group} rollouts per prompt; the pool has K={k}")
    s = rewards.sum(1)[:, None]
    ri, rj = rewards[:, :, None], rewards[:, None, :]
    diag = _expect(
        lambda c: _advantage(ri[..., 0], c, group, scale) ** 2, np.full_like(s, k - 1), s - ri[..., 0], group - 1
    )
    cross = _expect(
        lambda c: _advantage(ri, rj + c, group, scale) * _advantage(rj, ri + c, group, scale),
        np.full((1, 1, 1), k - 2),
        s[..., None] - ri - rj,
        group - 2,
    )
    weights = cross * group * (group - 1) / (k * (k - 1))
    idx = np.arange(k)
    weights[:, idx, idx] = diag * group / k
    slope = _expect(
        lambda c: _advantage(np.ones(1), c, group, scale) - _advantage(np.zeros(1), c, group, scale),
        np.full_like(s, k - 1),
        s - rewards,
        group - 1,
    )
    informative = None
    if informative_only:
        informative = 1 - hypergeom.pmf(0, k, s[:, 0], group) - hypergeom.pmf(group, k, s[:, 0], group)
    return RuleMoments(weights / group**2, slope * truth_weights(rewards), float(group), informative)


def pair_moments(rewards: np.ndarray, values: np.ndarray) -> RuleMoments:
    """G = 2 with the partner's value as the baseline, A_i = r_i − v_j (RLOO-2: v = r; POISE: the probe's value).
    Any rewards: the U-statistic over the K (K − 1) ordered pairs is explicit."""
    k = rewards.shape[1]
    ri, vj = rewards[:, :, None], values[:, None, :]
    a = ri - vj  # a[x, i, j] = r_i − v_j: rollout i's advantage when j is its partner
    weights = a * a.transpose(0, 2, 1)
    idx = np.arange(k)
    weights[:, idx, idx] = (a**2).sum(2) - a[:, idx, idx] ** 2
    return RuleMoments(weights / (2 * k * (k - 1)), truth_weights(rewards), 2.0)


def prefix_moments(rewards: np.ndarray, mix: float = 1.0, values: np.ndarray | None = None) -> RuleMoments:
    """G = 2 with a per-prefix baseline, A_{i,t} = r_i − (mix V_{i,t} + (1 − mix) v_j), on the per-prompt family
    [g_1..g_K, h_1..h_K] with h_i = Σ_t V_{i,t} ∇log π(y_t | x, y_<t): rollout i serves u_i = (r_i − (1 − mix) v_j) g_i
    − mix h_i, linear in the family, so E||Y/2||² is again a U-statistic over ordered pairs, exact. E[Y/2 | x] is μ_x
    (the truth's weights: slope 1 in r_i) minus mix E[h | x], and E[h | x] = 0 when V_{i,t} reads only x and y_<t
    (E[∇log π(y_t | x, y_<t) | x, y_<t] = 0): the weights use that identity, as every rule here uses E[g | x] = 0,
    so bias² is zero by construction; `family_mean` is the check of the identity on the pool."""
    num_prompts, k = rewards.shape
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"mix={mix}: the per-prefix baseline's weight must lie in [0, 1]")
    if mix < 1.0 and values is None:
        raise ValueError("a mix below 1 needs the partner's sequence `values` (P, K)")
    partner = np.zeros((num_prompts, k)) if values is None else values
    coef = np.zeros((num_prompts, k, k, 2 * k))  # coef[x, i, j] = u_i's weights on the family when j is its partner
    idx = np.arange(k)
    coef[:, idx, :, idx] = (rewards[:, :, None] - (1 - mix) * partner[:, None, :]).transpose(1, 0, 2)
    coef[:, idx, :, k + idx] = -mix
    pair = coef + coef.transpose(0, 2, 1, 3)  # Y of the group {i, j}
    pair[:, idx, idx] = 0.0
    second = np.einsum("xijf,xije->xfe", pair, pair) / (4 * k * (k - 1))
    return RuleMoments(second, np.pad(truth_weights(rewards), ((0, 0), (0, k))), 2.0)


def family_mean(num_prompts: int, k: int) -> np.ndarray:
    """(P, 2K) weights of the mean of the h_i within each prompt, an unbiased estimate of E[h | x]."""
    return np.concatenate([np.zeros((num_prompts, k)), np.full((num_prompts, k), 1 / k)], axis=1)


def oracle_moments(rewards: np.ndarray) -> tuple[RuleMoments, np.ndarray, np.ndarray]:
    """G = 2 with the true success rate p as the baseline (a value no model can beat), and the two weight matrices of
    W_x = E[(r − p)² ||g||² | x] and E||μ_x||² (so the within-prompt noise is their difference). p and p² are
    replaced by distinct other rollouts' rewards, so each is unbiased; any rewards, K ≥ 3."""
    num_prompts, k = rewards.shape
    if k < 3:
        raise ValueError(f"the oracle baseline needs K >= 3 rollouts per prompt, the pool has {k}")
    total, squares = rewards.sum(1, keepdims=True), (rewards**2).sum(1, keepdims=True)
    rest, rest_sq = total - rewards, squares - rewards**2
    pairs = (rest**2 - rest_sq) / ((k - 1) * (k - 2))  # mean r_k r_l over distinct others: unbiased p²
    noise = np.zeros((num_prompts, k, k))
    idx = np.arange(k)
    noise[:, idx, idx] = (rewards**2 - 2 * rewards * rest / (k - 1) + pairs) / k
    signal = rewards[:, :, None] * rewards[:, None, :] / (k * (k - 1))
    signal[:, idx, idx] = 0.0
    return RuleMoments((noise + signal) / 2, truth_weights(rewards), 2.0), noise, signal


def pair_sampler_score(rewards: np.ndarray, values: np.ndarray) -> np.ndarray:
    """sqrt(E[(r − b)² | x]) of a G = 2 partner-value rule, from the pool: the oracle prompt sampler's score."""
    k = rewards.shape[1]
    a2 = (rewards[:, :, None] - values[:, None, :]) ** 2
    return np.sqrt((a2.sum((1, 2)) - np.trace(a2, axis1=1, axis2=2)) / (k * (k - 1)))


# --------------------------------------------------------------------------------------------- gradients in
class PoolGram:
    """A pool's N = P K scores, read as within-prompt Gram blocks (P, K, K) and cross-prompt products of weighted
    sums; from the (N, N) Gram matrix (what `bench gradient` keeps) or from the (N, D) scores themselves. K is the
    number of vectors per prompt, in prompt-major order: the per-prefix family [g; h] is a pool of 2K."""

    def __init__(self, num_prompts: int, k: int, gram: np.ndarray | None = None, scores: np.ndarray | None = None):
        if (gram is None) == (scores is None):
            raise ValueError("give the Gram matrix or the scores, one of them")
        n = num_prompts * k
        if (gram if gram is not None else scores).shape[0] != n:
            raise ValueError(f"{n} rows expected for {num_prompts} prompts x {k} rollouts")
        self.shape, self.scores = (num_prompts, k), None
        if gram is not None:
            self.blocks = gram.reshape(num_prompts, k, num_prompts, k)
            self.within = np.einsum("xiyj->xyij", self.blocks)[np.arange(num_prompts), np.arange(num_prompts)]
        else:
            self.scores = scores.reshape(num_prompts, k, -1)
            self.within = np.einsum("xid,xjd->xij", self.scores, self.scores)

    def second(self, weights: np.ndarray) -> np.ndarray:
        """(P,) Σ_ij weights[x, i, j] g_i·g_j within each prompt."""
        return np.einsum("xij,xij->x", weights, self.within)

    def cross(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """(P, P) (Σ_i a_xi g_xi)·(Σ_j b_yj g_yj)."""
        if self.scores is None:
            return np.einsum("xi,xiyj,yj->xy", a, self.blocks, b)
        return np.einsum("xi,xid->xd", a, self.scores) @ np.einsum("yj,yjd->yd", b, self.scores).T


def distinct_pairs(matrix: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(R,) mean of matrix[x, y] over pairs of draws of distinct prompts, for each row of `counts` (R, P): the
    U-statistic of a product of two independent prompts' estimates, on a bootstrap resample."""
    diag = np.diagonal(matrix)
    num = np.einsum("rx,xy,ry->r", counts, matrix, counts) - (counts**2) @ diag
    return num / (counts.sum(1) ** 2 - (counts**2).sum(1))


def summarize(
    pool: PoolGram, rule: RuleMoments, truth: np.ndarray, counts: np.ndarray, sampler: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Per bootstrap row of `counts` (row 0 all ones: the point estimate): ||g||², the per-completion variance
    B tr Cov(ĝ), bias², E[ĝ]·g and ||E ĝ||². With `sampler` (P,) positive scores u_x, prompts are drawn with
    probability u_x / Σu and weighted by mean(u) / u_x, which keeps the mean and changes only E||Y/G||²."""
    weights = counts / counts.sum(1, keepdims=True)
    second = pool.second(rule.second)
    if sampler is not None:
        second = second * (weights @ sampler)[:, None] / sampler
        square = (weights * second).sum(1)
    else:
        square = weights @ second
    gg = distinct_pairs(pool.cross(truth, truth), counts)
    mm = distinct_pairs(pool.cross(rule.mean, rule.mean), counts)
    mg = distinct_pairs(pool.cross(rule.mean, truth), counts)
    cost = np.full(len(counts), rule.cost)
    if rule.informative is not None:  # a kept group: E[· | informative] = E[· 1_informative] / q
        q = weights @ rule.informative
        square, mm, mg, cost = square / q, mm / q**2, mg / q, cost / q
    return {"signal": gg, "variance": cost * (square - mm), "bias2": mm - 2 * mg + gg, "mean_dot": mg, "mean_sq": mm}


def bootstrap_counts(num_prompts: int, resamples: int, seed: int) -> np.ndarray:
    """(1 + resamples, P) prompt multiplicities: the pool itself, then resamples with replacement."""
    rng = np.random.default_rng(seed)
    draws = rng.integers(num_prompts, size=(resamples, num_prompts))
    counts = [np.bincount(row, minlength=num_prompts) for row in draws]
    return np.stack([np.ones(num_prompts), *counts]).astype(float)


def percentile_interval(replicates: np.ndarray, level: float = 0.95) -> list[float]:
    """Percentile bootstrap interval of the finite replicates."""
    finite = replicates[np.isfinite(replicates)]
    if not len(finite):
        return [float("nan"), float("nan")]
    return np.quantile(finite, [(1 - level) / 2, (1 + level) / 2]).tolist()


def point_and_interval(replicates: np.ndarray) -> dict[str, Any]:
    """{"value": the point estimate (row 0), "ci": the percentile interval of the bootstrap rows, or None}."""
    return {"value": float(replicates[0]), "ci": percentile_interval(replicates[1:]) if len(replicates) > 1 else None}
