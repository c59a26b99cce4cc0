"""Monte Carlo checks of the paper's two gradient claims on a contextual bandit whose policy gradient is exact.

Setting: contexts x ∈ {0..C-1} (uniform), a softmax policy π(a|x) ∝ exp θ[x, a] over A actions, and a binary
reward r ~ Bernoulli(p(x, a)). Then ∂J/∂θ[x, a] = π(a|x)(p(x, a) − V(x)) / C with V(x) = Σ_a π(a|x) p(x, a), and
the score of one sample is ∇ log π(a|x) = e_x ⊗ (e_a − π(·|x)). So any batch estimator can be compared with the
truth, not with another estimator.

- §2.2: a baseline built from a partner rollout (POISE's cross-rollout b_i = g(φ_j)) or from the partners' rewards
  (RLOO) keeps the batch gradient unbiased, while a baseline that sees the rollout's own features is biased.
- Proposition 1: at a fixed budget B = n·m, Cov(ĝ) = Σ_w/B + m·Σ_b/B, which grows with m.

The §2.2 checks take their advantages from `POISEEstimator.advantages` on plain tensors, the entry point every
training loop calls; Proposition 1 is about the allocation (n, m), with a fixed per-context baseline, and m = 1 has
no partner to take a cross-rollout baseline from, so it uses the bandit directly.
"""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chi2

from poise_trl.estimator.baselines import (
    RunningStd,
    cross_rollout_baselines,
    leave_one_out_targets,
    poise_advantages,
    shrunk_rloo_line,
)
from poise_trl.estimator.batch import DEFAULT_DOMAIN
from poise_trl.estimator.estimator import POISEEstimator, Rollouts
from poise_trl.estimator.row import append_reward_column
from poise_trl.estimator.specs import BufferSpec, EstimatorSpec, HistorySpec
from poise_trl.heads.probe import ValueProbe

C, A = 3, 4  # contexts, actions
NOISE_COLUMNS = 4  # feature columns that carry only noise
FEATURE_NOISE = 0.3
REPS = 50_000  # Monte Carlo batches per estimate

# Per-coordinate |z| beyond this would be a ~1e-4 event per coordinate: the unbiased estimators must stay below it.
UNBIASED_Z = 4.5
# The biased estimators must exceed this in some coordinate: far out of reach of MC noise.
BIASED_Z = 6.0


class Bandit:
    """Fixed θ and p; everything in float64 so MC error, not rounding, is what the tolerances cover."""

    def __init__(self, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.theta = torch.randn(C, A, generator=g, dtype=torch.float64) * 0.5
        # Success rates spread towards 0 and 1, like verifiable rewards on prompts of mixed difficulty.
        self.p = torch.sigmoid(4 * torch.randn(C, A, generator=g, dtype=torch.float64))
        self.pi = self.theta.softmax(-1)
        self.value = (self.pi * self.p).sum(-1)  # V(x)

    def exact_gradient(self) -> torch.Tensor:
        """∇_θ E_x E_a[r], flattened (C·A)."""
        return (self.pi * (self.p - self.value[:, None]) / C).reshape(-1)

    def sample(self, reps: int, n: int, m: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`reps` batches of n prompts × m rollouts: contexts (reps, n), actions and rewards (reps, n, m)."""
        x = torch.randint(C, (reps, n), generator=g)
        cdf = self.pi.cumsum(-1)[x].unsqueeze(2)  # (reps, n, 1, A)
        u = torch.rand(reps, n, m, 1, generator=g, dtype=torch.float64)
        a = (u > cdf).sum(-1).clamp(max=A - 1)
        r = (torch.rand(reps, n, m, generator=g, dtype=torch.float64) < self.p[x.unsqueeze(2), a]).double()
        return x, a, r

    def features(self, x: torch.Tensor, a: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """φ(x, a): one-hot of (x, a) plus noise columns, all with per-sample noise; it depends on the own action."""
        one_hot = F.one_hot(x.unsqueeze(-1).expand_as(a) * A + a, C * A).float()
        phi = torch.cat([one_hot, torch.zeros(*a.shape, NOISE_COLUMNS)], dim=-1)
        return phi + FEATURE_NOISE * torch.randn(phi.shape, generator=g)

    def batch_gradients(self, x: torch.Tensor, a: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        """ĝ per batch, (reps, C·A): the mean over the batch's n·m samples of A_ij ∇ log π(a_ij | x_i)."""
        reps, n, m = a.shape
        score = F.one_hot(a, A).double() - self.pi[x].unsqueeze(2)  # (reps, n, m, A): the block of context x
        per_prompt = (advantages.unsqueeze(-1) * score).sum(2)  # (reps, n, A)
        grads = torch.einsum("rnc,rna->rca", F.one_hot(x, C).double(), per_prompt)
        return grads.reshape(reps, C * A) / (n * m)


def fit_value_probe(bandit: Bandit, seed: int = 1) -> ValueProbe:
    """A ValueProbe fitted on the rollout's OWN reward: g(φ(x, a)) tracks p(x, a), so it leaks the own action.

    That is the worst case for a self baseline and is harmless for the cross-rollout one, which is the point.
    """
    g = torch.Generator().manual_seed(seed)
    x, a, r = bandit.sample(4000, 1, 1, g)
    probe = ValueProbe(alpha=1.0, clip=(0.0, 1.0))
    return probe.fit(bandit.features(x, a, g).reshape(-1, C * A + NOISE_COLUMNS), r.reshape(-1))


def bias_statistics(grads: torch.Tensor, exact: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """Per-coordinate z-scores of mean(ĝ) − ∇J, and the Mahalanobis χ² with its p-value.

    The score's coordinates sum to zero within each context, so the last action of each context is dropped before
    the χ² to leave a non-singular covariance (k = C·(A−1) degrees of freedom).
    """
    reps = grads.size(0)
    deviation = grads.mean(0) - exact
    z = deviation / (grads.std(0) / math.sqrt(reps))
    keep = torch.tensor([i % A != A - 1 for i in range(C * A)])
    d, cov = deviation[keep], torch.cov(grads[:, keep].T) / reps
    statistic = float(d @ torch.linalg.solve(cov, d))
    return z, statistic, float(chi2.sf(statistic, int(keep.sum())))


@pytest.fixture(scope="module")
def bandit() -> Bandit:
    return Bandit()


@pytest.fixture(scope="module")
def probe(bandit: Bandit) -> ValueProbe:
    return fit_value_probe(bandit)


def _rollouts(bandit: Bandit, probe: ValueProbe, n: int, m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, a, r = bandit.sample(REPS, n, m, g)
    phi = bandit.features(x, a, g)
    values = probe.predict(phi.reshape(-1, phi.size(-1))).double().reshape(a.shape)
    return x, a, r, values, phi.reshape(-1, phi.size(-1))


def estimator_with(probe: ValueProbe | None, group: int, **settings) -> POISEEstimator:
    """A `POISEEstimator` (paper settings unless `settings`, `EstimatorSpec` fields, override them) whose probe is
    `probe`, trusted as after a warm start; without a probe it is in its bootstrap."""
    paper = EstimatorSpec(partner_reward=False, bootstrap="rloo", buffer=BufferSpec(warmup_steps=0))
    estimator = POISEEstimator(group, replace(paper, **settings))
    if probe is not None:
        online = estimator.new_probe(DEFAULT_DOMAIN).replace(probe=probe, warm_started=True)
        estimator.state_ = replace(estimator.state_, probes={DEFAULT_DOMAIN: online})
    return estimator


def test_the_probe_leaks_the_own_action(bandit: Bandit, probe: ValueProbe):
    """Precondition of the bias test: g(φ) must track p(x, a) within a context, not only V(x)."""
    x, a, _, values, _ = _rollouts(bandit, probe, 1, 1, seed=99)
    p_own = bandit.p[x.unsqueeze(2), a]
    centered_v = values - bandit.value[x].unsqueeze(2)
    centered_p = p_own - bandit.value[x].unsqueeze(2)
    assert torch.corrcoef(torch.stack([centered_v.reshape(-1), centered_p.reshape(-1)]))[0, 1] > 0.5


@pytest.mark.parametrize(("n", "group"), [(4, 2), (4, 3)])
def test_cross_rollout_baseline_is_unbiased_and_self_baseline_is_not(bandit, probe, n, group):
    """A_i = r_i − g(φ_partner) has E[ĝ] = ∇J; A_i = r_i − g(φ_i) does not (paper §2.2)."""
    x, a, r, values, phi = _rollouts(bandit, probe, n, group, seed=10 + group)
    exact = bandit.exact_gradient()

    result = estimator_with(probe, group).advantages(phi, Rollouts(r.reshape(-1)))
    cross = cross_rollout_baselines(values.reshape(-1), group).reshape(values.shape)
    assert torch.isfinite(result.baselines).all()
    torch.testing.assert_close(result.baselines.reshape(r.shape), cross)  # b_i = mean of the partners' g(φ_j)
    z, statistic, p_value = bias_statistics(bandit.batch_gradients(x, a, result.advantages.reshape(r.shape)), exact)
    assert z.abs().max() < UNBIASED_Z, f"cross-rollout z={z}"
    assert p_value > 1e-4, f"cross-rollout χ²={statistic:.1f}"

    z_self, statistic_self, _ = bias_statistics(bandit.batch_gradients(x, a, r - values), exact)
    assert z_self.abs().max() > BIASED_Z, f"self-baseline z={z_self}"
    assert statistic_self > chi2.isf(1e-12, C * (A - 1)), f"self-baseline χ²={statistic_self:.1f}"


@pytest.mark.parametrize("group", [2, 4])
def test_rloo_baseline_is_unbiased_and_the_group_mean_with_self_is_not(bandit, group):
    """The bootstrap baseline (mean of the partners' rewards) is unbiased. The group mean that includes the own
    reward shrinks the gradient by (G−1)/G; detecting that shows the test has the power to see a bias."""
    g = torch.Generator().manual_seed(20 + group)
    x, a, r = bandit.sample(REPS, 4, group, g)
    exact = bandit.exact_gradient()

    rloo = leave_one_out_targets(r.reshape(-1), group).reshape(r.shape)
    advantages = estimator_with(None, group).advantages(torch.zeros(r.numel(), 1), Rollouts(r.reshape(-1))).advantages
    torch.testing.assert_close(advantages.reshape(r.shape), r - rloo)  # before any observe: the RLOO bootstrap
    z, statistic, p_value = bias_statistics(bandit.batch_gradients(x, a, advantages.reshape(r.shape)), exact)
    assert z.abs().max() < UNBIASED_Z, f"RLOO z={z}"
    assert p_value > 1e-4, f"RLOO χ²={statistic:.1f}"

    with_self = bandit.batch_gradients(x, a, r - r.mean(2, keepdim=True))
    z_mean, _, _ = bias_statistics(with_self, exact)
    assert z_mean.abs().max() > BIASED_Z
    shrink = (with_self.mean(0) @ exact) / (exact @ exact)
    assert shrink.item() == pytest.approx((group - 1) / group, abs=0.03)


def test_trainer_rule_with_action_dependent_feature_dropout_is_unbiased(bandit, probe):
    """The trainer's rule: probe baselines over rows with usable features, RLOO where a row has no such partner.

    Here a rollout's features are unusable (e.g. non-finite) with a probability that depends on its OWN action. That
    only decides whether it can serve as a partner, never its own baseline, so the gradient stays unbiased.
    """
    group = 3
    x, a, r, values, phi = _rollouts(bandit, probe, 4, group, seed=30)
    g = torch.Generator().manual_seed(31)
    drop_probability = torch.tensor([0.1, 0.6, 0.3, 0.8], dtype=torch.float64)[a]
    feature_ok = torch.rand(a.shape, generator=g, dtype=torch.float64) >= drop_probability
    values = torch.where(feature_ok, values, torch.full_like(values, float("nan")))

    rloo = leave_one_out_targets(r.reshape(-1), group)
    probe_baselines = cross_rollout_baselines(values.reshape(-1), group, feature_ok.reshape(-1))
    baselines = torch.where(torch.isnan(probe_baselines), rloo, probe_baselines).reshape(r.shape)
    assert 0.05 < torch.isnan(probe_baselines).double().mean() < 0.5  # the fallback is really exercised
    unusable = torch.where(feature_ok.reshape(-1, 1), phi, torch.full_like(phi, float("nan")))
    result = estimator_with(probe, group).advantages(unusable, Rollouts(r.reshape(-1)))
    torch.testing.assert_close(result.baselines.reshape(r.shape), baselines)
    advantages = result.advantages.reshape(r.shape)
    z, statistic, p_value = bias_statistics(bandit.batch_gradients(x, a, advantages), bandit.exact_gradient())
    assert z.abs().max() < UNBIASED_Z, f"trainer-rule z={z}"
    assert p_value > 1e-4, f"trainer-rule χ²={statistic:.1f}"

    # Contrast: zeroing the advantage of rows whose OWN features are unusable would bias the gradient.
    gated = torch.where(feature_ok, advantages, torch.zeros_like(r))
    z_gated, _, _ = bias_statistics(bandit.batch_gradients(x, a, gated), bandit.exact_gradient())
    assert z_gated.abs().max() > BIASED_Z


# --------------------------------------------------------------------------------------------- beyond the paper
def fit_partner_aware_probe(bandit: Bandit, seed: int = 2) -> ValueProbe:
    """h(φ_j, r_j) fitted, as the trainer fits it, on EARLIER pairs: input [φ_j, r_j], target the partner's reward."""
    g = torch.Generator().manual_seed(seed)
    x, a, r = bandit.sample(4000, 1, 2, g)
    phi = append_reward_column(bandit.features(x, a, g).reshape(-1, C * A + NOISE_COLUMNS), r.reshape(-1).float())
    return ValueProbe(alpha=1.0, clip=(0.0, 1.0)).fit(phi, leave_one_out_targets(r.reshape(-1), 2).float())


@pytest.mark.parametrize("group", [2, 3])
def test_partner_aware_baseline_is_unbiased_and_its_self_version_is_not(bandit, group):
    """b_i = mean over j != i of h(φ_j, r_j) uses the partners' own rewards, never r_i: unbiased. The same probe fed
    the row's own (φ_i, r_i) is strongly biased, which shows the test can see a bias."""
    probe = fit_partner_aware_probe(bandit)
    g = torch.Generator().manual_seed(50 + group)
    x, a, r = bandit.sample(REPS, 4, group, g)
    features = bandit.features(x, a, g).reshape(-1, C * A + NOISE_COLUMNS)
    phi = append_reward_column(features, r.reshape(-1).float())
    values = probe.predict(phi).double()
    flipped = probe.predict(torch.cat([phi[:, :-1], 1 - phi[:, -1:]], dim=1)).double()
    assert (values - flipped).abs().mean() > 0.05  # h really uses the reward column

    result = estimator_with(probe, group, partner_reward=True).advantages(features, Rollouts(r.reshape(-1).float()))
    baselines = cross_rollout_baselines(values, group).reshape(r.shape)
    torch.testing.assert_close(result.baselines.reshape(r.shape), baselines, check_dtype=False)
    advantages = result.advantages.double().reshape(r.shape)
    z, statistic, p_value = bias_statistics(bandit.batch_gradients(x, a, advantages), bandit.exact_gradient())
    assert z.abs().max() < UNBIASED_Z, f"partner-aware z={z}"
    assert p_value > 1e-4, f"partner-aware χ²={statistic:.1f}"

    z_self, _, _ = bias_statistics(bandit.batch_gradients(x, a, r - values.reshape(r.shape)), bandit.exact_gradient())
    assert z_self.abs().max() > BIASED_Z


@pytest.mark.parametrize("group", [2, 3])
def test_shrunk_bootstrap_from_earlier_steps_is_unbiased(bandit, group):
    """The shrunk bootstrap: b_i = a + w * RLOO_i with (a, w) learned by `observe` from an earlier batch, applied by
    `advantages`. Unbiased; refitting (a, w) on each batch's own pairs is not needed."""
    g = torch.Generator().manual_seed(60 + group)
    _, _, earlier = bandit.sample(500, 4, group, g)
    earlier = earlier.reshape(-1)
    intercept, weight = shrunk_rloo_line(leave_one_out_targets(earlier, group), earlier).tolist()
    assert abs(weight - 1) > 0.5  # a real shrinkage, not RLOO in disguise (this bandit: w ≈ 0.02)
    estimator = estimator_with(None, group, bootstrap="shrunk", buffer=BufferSpec(size=10**5, warmup_steps=10**6))
    estimator.observe(features=torch.zeros(earlier.numel(), 1), rollouts=Rollouts(earlier))

    x, a, r = bandit.sample(REPS, 4, group, g)
    rewards = r.reshape(-1)
    fallback = intercept + weight * leave_one_out_targets(rewards, group)
    result = estimator.advantages(torch.zeros(rewards.numel(), 1), Rollouts(rewards))
    torch.testing.assert_close(result.baselines, fallback)
    ones = torch.ones_like(rewards, dtype=torch.bool)
    values = torch.full_like(rewards, float("nan"))
    _, baselines, _ = poise_advantages(rewards, values, group, ones, ones, ~ones, fallback)
    assert torch.equal(baselines, fallback)  # the rule the estimator applies, with the line given
    advantages = result.advantages
    z, statistic, p_value = bias_statistics(
        bandit.batch_gradients(x, a, advantages.reshape(r.shape)), bandit.exact_gradient()
    )
    assert z.abs().max() < UNBIASED_Z, f"shrunk z={z}"
    assert p_value > 1e-4, f"shrunk χ²={statistic:.1f}"


def test_shrunk_bootstrap_is_exactly_unbiased_and_a_line_fitted_on_the_own_step_is_not(bandit):
    """Enumerating every batch of one prompt × 3 binary rewards: the estimator's shrunk baseline (1 - w) r̄ + w m_i,
    with its line fitted on an earlier step, gives E[ĝ] = ∇J to rounding. The same rule with the line fitted on the
    batch's own pairs is biased: one group fits w = 0, and the baseline is the group's mean, own reward included."""
    group, exact, unscaled = 3, bandit.exact_gradient(), lambda r: torch.ones(r.size(0), dtype=torch.float64)
    earlier = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    estimator = estimator_with(None, group, bootstrap="shrunk", buffer=BufferSpec(warmup_steps=10**6))
    estimator.observe(features=torch.zeros(earlier.numel(), 1), rollouts=Rollouts(earlier))
    intercept, weight = estimator.bootstrap_lines_[DEFAULT_DOMAIN].tolist()
    assert 0 < weight < 1 and intercept > 0  # both the earlier mean and the partners' mean enter

    def shrunk(rewards: torch.Tensor) -> torch.Tensor:
        flat = rewards.reshape(-1).float()
        result = estimator.advantages(torch.zeros(flat.numel(), 1), Rollouts(flat))
        return result.baselines.double().reshape(rewards.shape)

    def own_step_line(rewards: torch.Tensor) -> torch.Tensor:
        partners = _rloo(rewards)
        lines = [shrunk_rloo_line(m, r) for m, r in zip(partners, rewards, strict=True)]
        return torch.stack([a + w * m for (a, w), m in zip(lines, partners, strict=True)])

    torch.testing.assert_close(exact_expected_gradient(bandit, group, unscaled, shrunk), exact, rtol=1e-10, atol=1e-14)
    leaked = exact_expected_gradient(bandit, group, unscaled, own_step_line)
    assert (leaked - exact).norm() > 0.3 * exact.norm()  # E[ĝ] = (1 - 1/G) ∇J: a third short


def test_history_baseline_is_unbiased_and_one_holding_the_own_rollouts_is_not(bandit):
    """With `history`, a prompt's history columns come from earlier steps only: b_i = mean over j != i of h(φ_j, H)
    stays unbiased. Every group is a prompt of its own, whose history holds one earlier group of its context: were a
    step's own rewards to reach its history before its baselines, every group's mean would move by half, where ids
    shared by a context's groups dilute the same leak over the whole batch past detection. The estimator with that
    leak planted (its history updated with the step's rewards before `advantages`) is biased: the test can see it."""
    group, prompts = 2, 4
    reps = REPS // 10  # 20,000 groups, each its own prompt id
    probe_rows = torch.rand(4000, NOISE_COLUMNS + 3, generator=torch.Generator().manual_seed(71))
    probe_rows[:, NOISE_COLUMNS] = 1.0  # seen
    probe = ValueProbe(alpha=1e-3, clip=(0.0, 1.0)).fit(probe_rows, probe_rows[:, -1])  # h reads the mean reward
    g = torch.Generator().manual_seed(72)
    x, a, r = bandit.sample(reps, prompts, group, g)
    keys = torch.arange(reps * prompts).repeat_interleave(group)  # one prompt id per group
    earlier = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])[x].reshape(-1)  # an earlier group of its context
    noise = FEATURE_NOISE * torch.randn(r.numel(), NOISE_COLUMNS, generator=g)

    def bias(*past: torch.Tensor) -> tuple[torch.Tensor, float, float]:
        """`bias_statistics` of the estimator's advantages, its history holding `past` (a step's rewards each)."""
        estimator = estimator_with(probe, group, history=HistorySpec())
        for rewards in past:
            history = estimator.prompt_history_.updated(keys, rewards)
            estimator.state_ = replace(estimator.state_, prompt_history=history)
        advantages = estimator.advantages(noise, Rollouts(r.reshape(-1), prompt_ids=keys)).advantages.reshape(r.shape)
        return bias_statistics(bandit.batch_gradients(x, a, advantages), bandit.exact_gradient())

    z, statistic, p_value = bias(earlier)
    assert z.abs().max() < UNBIASED_Z, f"history z={z}"
    assert p_value > 1e-4, f"history χ²={statistic:.1f}"
    z_leak, _, _ = bias(earlier, r.reshape(-1))  # the leak: this step's rewards in its history before its baselines
    assert z_leak.abs().max() > BIASED_Z, f"leaked-history z={z_leak}"


# ------------------------------------------------------------------------------------------------- Proposition 1
def exact_covariances(bandit: Bandit, baseline: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_w = E_x Cov(Z | x) and Σ_b = Cov_x(μ(x)), μ(x) = E[Z | x], for Z = ∇ log π(a|x)(r − b(x)), by enumeration."""
    dim = C * A
    mu = torch.zeros(C, dim, dtype=torch.float64)
    second = torch.zeros(C, dim, dim, dtype=torch.float64)
    for x in range(C):
        b = baseline[x]
        for a in range(A):
            score = torch.zeros(C, A, dtype=torch.float64)
            score[x] = -bandit.pi[x]
            score[x, a] += 1
            score = score.reshape(-1)
            p = bandit.p[x, a]
            mean_adv, mean_sq_adv = p - b, p * (1 - b) ** 2 + (1 - p) * b**2
            mu[x] += bandit.pi[x, a] * mean_adv * score
            second[x] += bandit.pi[x, a] * mean_sq_adv * torch.outer(score, score)
    within = (second - torch.einsum("xi,xj->xij", mu, mu)).mean(0)
    centered = mu - mu.mean(0)
    between = centered.T @ centered / C
    return within, between


BUDGET = 12
ALLOCATIONS = [(12, 1), (6, 2), (3, 4), (1, 12)]  # (n prompts, m rollouts), n·m = B


@pytest.mark.parametrize("baseline_name", ["none", "imperfect_value"])
def test_gradient_variance_decomposition(bandit, baseline_name):
    """Cov(ĝ) = Σ_w/B + m·Σ_b/B for every (n, m) with n·m = B, and it is non-decreasing in m (Prop. 1, Cor. 1)."""
    baseline = torch.zeros(C, dtype=torch.float64)
    if baseline_name == "imperfect_value":
        baseline = bandit.value + torch.tensor([0.15, -0.1, 0.05], dtype=torch.float64)
    within, between = exact_covariances(bandit, baseline)
    directions = {
        "top Σ_b": torch.linalg.eigh(between)[1][:, -1],
        "top Σ_w": torch.linalg.eigh(within)[1][:, -1],
        "random": torch.randn(C * A, generator=torch.Generator().manual_seed(5), dtype=torch.float64),
    }
    g = torch.Generator().manual_seed(40)
    traces = []
    for n, m in ALLOCATIONS:
        x, a, r = bandit.sample(REPS, n, m, g)
        grads = bandit.batch_gradients(x, a, r - baseline[x].unsqueeze(2))
        measured, predicted = torch.cov(grads.T), within / BUDGET + m * between / BUDGET
        assert measured.trace().item() == pytest.approx(predicted.trace().item(), rel=0.05), (n, m)
        for name, v in directions.items():
            assert (v @ measured @ v).item() == pytest.approx((v @ predicted @ v).item(), rel=0.08), (n, m, name)
        assert torch.linalg.matrix_norm(measured - predicted) < 0.08 * torch.linalg.matrix_norm(predicted), (n, m)
        traces.append(measured.trace().item())

    # The spread across allocations must dwarf the 5% tolerance, or the ordering below would prove nothing.
    spread = (within.trace() + BUDGET * between.trace()) / (within.trace() + between.trace())
    assert spread > 1.5
    assert traces == sorted(traces) and traces[-1] > 1.4 * traces[0], traces


# ------------------------------------------------------------------------------------------ scale_rewards="batch"
def _rloo(rewards: torch.Tensor) -> torch.Tensor:
    return leave_one_out_targets(rewards.reshape(-1), rewards.size(1)).reshape(rewards.shape)


def exact_expected_gradient(bandit: Bandit, group: int, scale, baseline=_rloo) -> torch.Tensor:
    """E[ĝ] for batches of ONE prompt × `group` rollouts with the advantage r - `baseline(rewards)` (RLOO unless
    given; (batches, group) in and out) divided by `scale(rewards)`, by enumerating every batch (no Monte Carlo): a
    bias this small would be invisible at any affordable number of reps."""
    outcomes = torch.tensor([(a, r) for a in range(A) for r in (0, 1)])  # (2A, 2)
    combos = torch.cartesian_prod(*[torch.arange(len(outcomes))] * group)  # (2A^group, group)
    actions, rewards = outcomes[combos, 0], outcomes[combos, 1].double()
    advantages = (rewards - baseline(rewards)) / scale(rewards).unsqueeze(1)
    expected = torch.zeros(C * A, dtype=torch.float64)
    for x in range(C):
        p_outcome = bandit.pi[x, actions] * torch.where(rewards > 0, bandit.p[x, actions], 1 - bandit.p[x, actions])
        score = F.one_hot(actions, A).double() - bandit.pi[x]  # (combos, group, A)
        per_batch = (advantages.unsqueeze(-1) * score).sum(1) / group  # (combos, A)
        block = (p_outcome.prod(1).unsqueeze(1) * per_batch).sum(0) / C
        expected[x * A : (x + 1) * A] = block
    return expected


def _off_direction(vector: torch.Tensor, direction: torch.Tensor) -> float:
    """Relative norm of the part of `vector` not parallel to `direction`."""
    parallel = (vector @ direction) / (direction @ direction) * direction
    return ((vector - parallel).norm() / vector.norm()).item()


def test_batch_std_of_the_own_batch_biases_the_gradient_direction(bandit):
    """TRL's scale_rewards="batch" divides by the std of a batch that contains each rollout's own reward: exactly
    enumerated, E[ĝ] leaves the direction of ∇J (groups of 4 binary rewards). Unscaled, it is ∇J to rounding."""
    exact = bandit.exact_gradient()
    unscaled = exact_expected_gradient(bandit, 4, lambda r: torch.ones(r.size(0), dtype=torch.float64))
    torch.testing.assert_close(unscaled, exact, rtol=1e-10, atol=1e-14)
    own_batch = exact_expected_gradient(bandit, 4, lambda r: r.std(1) + 1e-4)
    assert _off_direction(own_batch, exact) > 2e-3  # measured 5.7e-3 with this bandit


def test_batch_scaling_by_earlier_steps_rewards_is_unbiased(bandit):
    """POISE's scale_rewards="batch": step t divides by `RunningStd` over the rewards of steps < t, a constant given
    the past. Monte Carlo over a sequence of steps: E[ĝ_t / s_t] = ∇J · E[1 / s_t]."""
    n, group, reps = 4, 2, 20_000
    g = torch.Generator().manual_seed(60)
    x, a, r = bandit.sample(reps, n, group, g)
    advantages = r - leave_one_out_targets(r.reshape(-1), group).reshape(r.shape)
    running, divisors = RunningStd(), torch.empty(reps, dtype=torch.float64)
    for step in range(reps):
        divisors[step] = running.divisor()  # from earlier steps only, then this step's rewards join
        running.update(r[step].reshape(-1))
    assert divisors[0] == 1.0 and divisors[1:].std() > 0
    grads = bandit.batch_gradients(x, a, advantages) / divisors.unsqueeze(1)
    z, statistic, p_value = bias_statistics(grads, bandit.exact_gradient() * (1 / divisors).mean())
    assert z.abs().max() < UNBIASED_Z, f"earlier-std z={z}"
    assert p_value > 1e-4, f"earlier-std χ²={statistic:.1f}"
