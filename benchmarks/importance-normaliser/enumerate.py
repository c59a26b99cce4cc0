"""The importance sampler's expected step against the uniform one, by exact enumeration of every draw.

A pool of n = 8 candidate prompts, each with G = 2 fixed rollouts: reward r ~ Bernoulli(p), completion length L in
[40, 300] tokens, a score sum_t grad log pi(y_t) of dimension 16 (sqrt(L) x unit noise + L x a prompt direction),
advantage r - v with v the sampler's prediction of p (p + N(0, 0.15), clipped). The sampler draws k prompts with
replacement with probability q = `importance_probabilities(v, 0, 1, floor 0.5)` and weight w = 1 / (n q); a draw
is a count vector c over the pool, so every draw is enumerated with its multinomial probability (k = 16: 245,157 count
vectors). The step of a draw under each normaliser (loss-token sum sum_x c_x w_x N_x, N_x = sum_j A_xj S_xj):

- grpo: sum_x c_x w_x sum_j A_xj S_xj / L_xj / (k G)  (each sequence over its own tokens; sapo alike);
- dr_grpo: sum_x c_x w_x N_x / (k G 300)              (a constant; luspo alike);
- dapo, unweighted count (before): sum_x c_x w_x N_x / sum_x c_x T_x  (T_x = sum_j L_xj; cispo, vespo alike);
- dapo, weighted count:             sum_x c_x w_x N_x / sum_x c_x w_x T_x;
- dapo, self-normalised weighted count (what POISETrainer uses): the weighted count times k / sum_x c_x w_x, i.e.
  the weighted count of a draw whose weights are rescaled to sum to k; the weights' own fluctuation cancels.

The reference is the same enumeration with q uniform (weights 1): the uniform step's expectation at the same k. The
figure is ||E_q[step] - E_uniform[step]|| / ||E_uniform[step]|| over 200 random pools (median, 95th percentile,
max) and the least cosine, in two pool families: lengths independent of p, and lengths rising with difficulty
(L = 40 + 260 (1 - p) + N(0, 40)). "k -> inf" is the large-batch limit in closed form: sum N / sum T for the weighted
counts (both) and the uniform step alike (difference 0), (mean_x N_x) / (sum_x q_x T_x) for the unweighted count.

    PYTHONPATH=. python benchmarks/importance-normaliser/enumerate.py > benchmarks/importance-normaliser/results.md

tests/test_importance_objective.py recomputes the k = 4 rows (the issue's setting) and compares them to this file.
"""

import math
import sys

import torch

from poise_trl.sampling import importance_probabilities, importance_weights

N, G, D, FLOOR, POOLS = 8, 2, 16, 0.5, 200
LENGTHS = (40, 300)
RULES = ("grpo", "dr_grpo", "dapo_unweighted", "dapo_weighted", "dapo_self_normalised")


def compositions(n: int, k: int) -> torch.Tensor:
    """Every count vector of k draws over n candidates, (M, n)."""
    if n == 1:
        return torch.tensor([[k]])
    return torch.cat(
        [
            torch.cat([torch.full((len(rest), 1), c), rest], 1)
            for c in range(k + 1)
            for rest in [compositions(n - 1, k - c)]
        ]
    )


def pool(seed: int, correlated: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(N, generator=g, dtype=torch.float64)
    v = (p + 0.15 * torch.randn(N, generator=g, dtype=torch.float64)).clamp(0, 1)
    r = (torch.rand(N, G, generator=g, dtype=torch.float64) < p[:, None]).double()
    low, high = LENGTHS
    if correlated:
        base = low + (high - low) * (1 - p)[:, None]
        lengths = (base + 40 * torch.randn(N, G, generator=g, dtype=torch.float64)).round().clamp(low, high)
    else:
        lengths = torch.randint(low, high + 1, (N, G), generator=g).double()
    direction = 0.3 * torch.randn(N, D, generator=g, dtype=torch.float64)
    noise = torch.randn(N, G, D, generator=g, dtype=torch.float64)
    scores = lengths[..., None].sqrt() * noise + lengths[..., None] * direction[:, None]
    return {"v": v, "L": lengths, "S": scores, "A": r - v[:, None]}


def expected_steps(P: dict[str, torch.Tensor], q: torch.Tensor, counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """E over every draw of k prompts from q (count vectors `counts`) of each rule's step, (D,) each."""
    k = int(counts[0].sum())
    c = counts.double()
    prob = (math.lgamma(k + 1) - torch.lgamma(c + 1).sum(1) + (c * q.log()).sum(1)).exp()
    cw = c * importance_weights(q)
    full = (P["A"][..., None] * P["S"]).sum(1)  # (n, D): N_x
    per_sequence = (P["A"][..., None] * P["S"] / P["L"][..., None]).sum(1)
    tokens = P["L"].sum(1)
    numerator = cw @ full
    steps = {
        "grpo": cw @ per_sequence / (k * G),
        "dr_grpo": numerator / (k * G * LENGTHS[1]),
        "dapo_unweighted": numerator / (c @ tokens)[:, None],
        "dapo_weighted": numerator / (cw @ tokens)[:, None],
        "dapo_self_normalised": numerator / ((cw @ tokens) * k / cw.sum(1))[:, None],
    }
    return {name: prob @ step for name, step in steps.items()}


def limits(P: dict[str, torch.Tensor], q: torch.Tensor) -> dict[str, torch.Tensor]:
    """The k -> inf steps of the token-count rules."""
    full, tokens = (P["A"][..., None] * P["S"]).sum(1), P["L"].sum(1)
    return {
        "dapo_unweighted": full.mean(0) / (q @ tokens),
        "dapo_weighted": full.mean(0) / tokens.mean(),
        "dapo_self_normalised": full.mean(0) / tokens.mean(),
    }


def differences(seed: int, correlated: bool, counts: torch.Tensor | None) -> dict[str, tuple[float, float]]:
    """Each rule's (relative difference, cosine) of the sampler's expected step to the uniform one."""
    P = pool(seed, correlated)
    q = importance_probabilities(P["v"], 0.0, 1.0, FLOOR)
    uniform = torch.full_like(q, 1 / N)
    if counts is None:
        sampled, reference = limits(P, q), limits(P, uniform)
    else:
        sampled, reference = expected_steps(P, q, counts), expected_steps(P, uniform, counts)
    out = {}
    for name, step in sampled.items():
        ref = reference["dapo_unweighted" if name.startswith("dapo") else name]
        out[name] = ((step - ref).norm() / ref.norm()).item(), torch.cosine_similarity(step, ref, 0).item()
    return out


def summary(k: int | None, correlated: bool, pools: int = POOLS) -> dict[str, dict[str, float]]:
    counts = None if k is None else compositions(N, k)
    rows = [differences(seed, correlated, counts) for seed in range(pools)]
    out = {}
    for name in rows[0]:
        rel = torch.tensor([row[name][0] for row in rows], dtype=torch.float64)
        cos = torch.tensor([row[name][1] for row in rows], dtype=torch.float64)
        out[name] = {
            "median": rel.median().item(),
            "p95": rel.quantile(0.95).item(),
            "max": rel.max().item(),
            "cos_min": cos.min().item(),
        }
    return out


def main() -> None:
    print("| k | lengths | rule | median | 95th pct | max | least cosine |")
    print("|---|---|---|---:|---:|---:|---:|")
    for k in (4, 8, 16, None):
        for correlated in (False, True):
            for name, row in summary(k, correlated).items():
                label = "k -> inf" if k is None else str(k)
                family = "rise with difficulty" if correlated else "independent"
                print(
                    f"| {label} | {family} | {name} | {row['median']:.4f} | {row['p95']:.4f} | {row['max']:.4f} "
                    f"| {row['cos_min']:.5f} |"
                )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
