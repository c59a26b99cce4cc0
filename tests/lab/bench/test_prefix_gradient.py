"""The per-prefix rows of `bench gradient`: exact moments of a per-token baseline against brute-force Monte Carlo on
a synthetic population with per-token scores and a known true gradient, and the unbiasedness check ||E h||² that a
baseline reading its own token fails."""

import json

import numpy as np
import pytest
import torch

from poise_lab.bench.exact import (
    PoolGram,
    bootstrap_counts,
    distinct_pairs,
    family_mean,
    pair_moments,
    percentile_interval,
    prefix_moments,
    summarize,
    truth_weights,
)
from poise_lab.bench.prefix_gradient import PREFIX_ROWS, rollout_gradients
from poise_lab.bench.value.collect import Collection
from poise_lab.bench.value.prefix import prefix_probe_settings
from poise_trl import cli

TYPES, TOKENS, DIM, K = 10, 4, 4, 12
RNG = np.random.default_rng(0)
P_TOKEN = np.concatenate([[[0.02, 0.5, 0.5, 0.5]], RNG.uniform(0.2, 0.9, (TYPES - 1, TOKENS))])  # (x, t)
DIRECTION = RNG.normal(size=(TYPES, TOKENS, DIM)) * np.linspace(2, 6, TYPES)[:, None, None]
P1, P2 = P_TOKEN[:, 0], P_TOKEN[:, 1]
# r = y_1 y_2: decided at the second token, two tokens after it; E[r s_t | x] is zero beyond t = 2
TRUE_GRADIENT = (P1 * (1 - P1) * P2)[:, None] * DIRECTION[:, 0] + (P1 * P2 * (1 - P2))[:, None] * DIRECTION[:, 1]
G_TRUE = TRUE_GRADIENT.mean(0)


def _rollouts(types: np.ndarray, size: int, rng: np.random.Generator, causal: bool = True) -> tuple[np.ndarray, ...]:
    """Rewards (n, size), the per-rollout score g and h = Σ_t V_t s_t (n, size, DIM), and a partner value v.

    Tokens are independent Bernoulli(p_{x,t}); s_t = (y_t − p_t) e_{x,t} + noise (E[s_t | x, y_<t] = 0). The causal
    V_t is 0.8 E[r | x, y_<t] + 0.1; the non-causal one E[r | x, y_≤t] has seen the token it weighs."""
    p = P_TOKEN[types][:, None]  # (n, 1, T)
    y = (rng.random(types.shape + (size, TOKENS)) < p).astype(float)
    s = (y - p)[..., None] * DIRECTION[types][:, None] + 0.3 * rng.normal(size=y.shape + (DIM,))
    r = y[..., 0] * y[..., 1]
    p1, p2 = np.broadcast_to(p[..., 0], r.shape), np.broadcast_to(p[..., 1], r.shape)
    if causal:
        value = np.stack([p1 * p2, y[..., 0] * p2, r, r], -1)
        value = 0.8 * value + 0.1
    else:
        value = np.stack([y[..., 0] * p2, r, r, r], -1)
    v = np.clip(0.6 * p1 * p2 + 0.3 * r + 0.1 * rng.normal(size=r.shape), 0, 1)
    return r, s.sum(-2), (value[..., None] * s).sum(-2), v


def _monte_carlo(mix: float, causal: bool, rng: np.random.Generator, n: int = 200_000) -> dict:
    """Fresh prompts and pairs: u_i = Σ_t (r_i − mix V_{i,t} − (1 − mix) v_j) s_{i,t}, Y = (u_1 + u_2) / 2."""
    types = rng.integers(TYPES, size=n)
    r, g, h, v = _rollouts(types, 2, rng, causal)
    u = (r - (1 - mix) * v[:, ::-1])[..., None] * g - mix * h
    y = u.sum(1) / 2
    mean = y.mean(0)
    square = (y**2).sum(1).mean()
    return {"square": square, "variance": 2 * (square - mean @ mean), "mean_dot": mean @ G_TRUE}


def _pool(causal: bool, per_type: int = 500) -> tuple[np.ndarray, np.ndarray, PoolGram]:
    rng = np.random.default_rng(1)
    types = np.repeat(np.arange(TYPES), per_type)  # every prompt type equally often: the pool's mix adds no noise
    r, g, h, v = _rollouts(types, K, rng, causal)
    family = np.concatenate([g, h], 1).reshape(-1, DIM)  # prompt-major: a prompt's K g's, then its K h's
    return r, v, PoolGram(len(r), 2 * K, scores=family)


@pytest.mark.parametrize("causal", [True, False])
def test_per_prefix_moments_match_brute_force_monte_carlo(causal):
    """E||Y/2||² for any V; the variance, with bias² zero by construction, for a V that reads only x and y_<t (the
    non-causal V's mean is not g: the check below catches it)."""
    r, v, pool = _pool(causal)
    counts, truth = bootstrap_counts(len(r), 0, 0), np.pad(truth_weights(r), ((0, 0), (0, K)))
    rng = np.random.default_rng(2)
    for mix in (1.0, 0.5):
        moments = prefix_moments(r, mix, v)
        brute = _monte_carlo(mix, causal, rng)
        assert pool.second(moments.second).mean() == pytest.approx(brute["square"], rel=0.02), mix
        if causal:
            exact = summarize(pool, moments, truth, counts)
            assert exact["variance"][0] == pytest.approx(brute["variance"], rel=0.02), mix
            assert brute["mean_dot"] == pytest.approx(G_TRUE @ G_TRUE, rel=0.05)  # the known mean: E ĝ = g
            assert abs(exact["bias2"][0]) < 1e-12 * exact["signal"][0]
    # the sequence-level rule, padded onto the family, is the same rule
    assert summarize(pool, pair_moments(r, v).padded(2 * K), truth, counts)["variance"][0] == pytest.approx(
        _monte_carlo(0.0, causal, rng)["variance"], rel=0.02
    )


def test_the_unbiasedness_check_catches_a_baseline_that_reads_its_token():
    """||E h||² / ||g||²: its interval holds 0 for a causal per-prefix value; a value that has seen y_t makes E h
    equal the true gradient here (E[r | y_≤t] s_t carries all of E[r s_t]), so the check reads 1."""
    for causal in (True, False):
        r, v, pool = _pool(causal, per_type=40)
        counts = bootstrap_counts(len(r), 500, 0)
        truth = np.pad(truth_weights(r), ((0, 0), (0, K)))
        signal = distinct_pairs(pool.cross(truth, truth), counts)
        mean_h = family_mean(len(r), K)
        check = distinct_pairs(pool.cross(mean_h, mean_h), counts) / signal
        low, high = percentile_interval(check[1:])
        if causal:
            assert low < 0 < high and abs(check[0]) < 0.1
        else:
            assert check[0] == pytest.approx(1.0, abs=0.2) and low > 0.5


def test_bad_mixes_are_refused():
    rewards = np.zeros((2, 4))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        prefix_moments(rewards, 1.5)
    with pytest.raises(ValueError, match="partner's sequence"):
        prefix_moments(rewards, 0.5)


def test_rollout_gradients_return_h_as_the_gradient_of_the_value_weighted_log_probs(tiny_model_path, tmp_path):
    """h from the second backward pass: a constant V = c gives h = c g exactly; a V on the last token only gives
    that token's score, g minus the gradient of the earlier tokens' log-probs (linearity in V)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "gradient"
    assert cli.main(_argv(tiny_model_path, tmp_path, out, ["rloo2"])) == 0  # makes and caches a pool
    folder = next((tmp_path / "cache" / "gradient").iterdir())
    pool = Collection.load(folder / "pool.safetensors")

    def grads(values):
        model = AutoModelForCausalLM.from_pretrained(pool.meta["model_path"], dtype=torch.float32)
        return rollout_gradients(model, pool, token_values=values)

    constant = grads(lambda i, hidden, entropies: torch.full_like(entropies, 0.3))
    assert set(constant) == {"lora", "norms", "lora_h", "norms_h"}
    for name in ("lora", "norms"):
        scale = constant[name].abs().max().item()
        torch.testing.assert_close(constant[f"{name}_h"], 0.3 * constant[name], rtol=1e-4, atol=1e-5 * scale)
    last = grads(lambda i, hidden, entropies: torch.eye(entropies.numel())[-1] * (i + 1))
    earlier = grads(lambda i, hidden, entropies: 1 - torch.eye(entropies.numel())[-1])
    index = torch.arange(1, pool.rewards.numel() + 1, dtype=torch.float32)[:, None]
    scale = last["lora"].abs().max().item()
    torch.testing.assert_close(last["lora_h"] / index + earlier["lora_h"], last["lora"], rtol=1e-4, atol=1e-5 * scale)
    with pytest.raises(RuntimeError, match="token values of shape"):
        grads(lambda i, hidden, entropies: torch.zeros(entropies.numel() + 1))


def _argv(model, tmp_path, out, contenders):
    argv = ["bench", "gradient", str(model), "--dataset", "sort", "--num-prompts", "10", "--k", "8"]
    argv += ["--reward-fn", "tests.lab.bench.test_gradient:parity_reward", "--max-new-tokens", "6", "--device", "cpu"]
    argv += ["--pool-tokens", "3", "--bootstrap", "20", "--probe-prompts", "24", "--contenders", *contenders]
    return argv + ["--cache-dir", str(tmp_path / "cache"), "--output-dir", str(out)]


def test_command_adds_the_per_prefix_rows_and_caches_their_pass(tiny_model_path, tmp_path):
    out = tmp_path / "gradient"
    rules = ["grpo8", "rloo2", "poise"]
    assert cli.main(_argv(tiny_model_path, tmp_path, out, rules)) == 0
    folder = next((tmp_path / "cache" / "gradient").iterdir())
    assert not (folder / "prefix_grams.safetensors").exists()  # rows without prefix values never make it
    plain = json.loads((out / "results.json").read_text())
    assert cli.main(_argv(tiny_model_path, tmp_path, out, [*rules, *PREFIX_ROWS])) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["cached"] and (folder / "prefix_grams.safetensors").exists()
    for subspace in ("lora", "norms"):
        table = results["subspaces"][subspace]["table"]
        for rule in rules:  # the sequence-level rows did not move
            assert table[rule] == plain["subspaces"][subspace]["table"][rule]
        check = results["prefix"]["subspaces"][subspace]["mean_h_sq_over_signal"]
        assert np.isfinite(check["value"]) and check["ci"][0] <= check["value"] <= check["ci"][1]
        for rule in PREFIX_ROWS:
            cell = table[rule]
            assert {"share_grpo8", "share_rloo2", "share_poise"} <= set(cell)
            assert cell["variance"]["value"] > 0
            # the family's comparators are the pool's own rows: a share against them is a ratio of the same numbers
            assert cell["share_poise"]["value"] == pytest.approx(
                cell["matched_variance"]["value"] / table["poise"]["matched_variance"]["value"], rel=1e-6
            )
        # poise_prefix under the probe sampler: unbiased, its own variance (the sampler's q is not uniform)
        sampled = table["poise_prefix_probe_sampler"]
        assert abs(sampled["bias2"]["value"]) < 1e-9
        assert sampled["variance"]["value"] != pytest.approx(table["poise_prefix"]["variance"]["value"])
    report = (out / "results.md").read_text()
    assert "POISE per-prefix G=2" in report and "||E h||² / ||g||²" in report
    assert "POISE per-prefix + probe sampler G=2" in report
    seconds = results["seconds"]
    assert seconds["prefix_gradients"] > 0
    assert cli.main(_argv(tiny_model_path, tmp_path, out, [*rules, *PREFIX_ROWS])) == 0  # from the cache
    again = json.loads((out / "results.json").read_text())
    assert again["prefix"]["subspaces"] == results["prefix"]["subspaces"]
    # a Gram made with other per-prefix probe settings is recomputed, not reused
    info = folder / "prefix_grams.json"
    stale = json.loads(info.read_text())
    stale["settings"]["alpha"] *= 2
    info.write_text(json.dumps(stale))
    assert cli.main(_argv(tiny_model_path, tmp_path, out, [*rules, *PREFIX_ROWS])) == 0
    assert json.loads(info.read_text())["settings"] == results_settings(folder)
    assert json.loads((out / "results.json").read_text())["prefix"]["subspaces"] == results["prefix"]["subspaces"]


def results_settings(folder):
    """The settings the command keys its per-prefix cache with: the trainer's prefix probe's, plus the pool's."""
    pool = Collection.load(folder / "probe_pool.safetensors")
    return {**prefix_probe_settings(pool.meta), "probe_prompts": 24, "seed": 0}


def test_the_prefix_probe_settings_are_the_trainers(tiny_model_path, tmp_path):
    """`bench gradient` and `probe-bench --prefix` fit the per-prefix probe the trainer builds from
    POISEConfig(probe_granularity="prefix"): its estimator's alpha, PCA dims, clip, and the window and samples."""
    from poise_trl import POISEConfig
    from poise_trl.estimator.estimator import POISEEstimator
    from poise_trl.features.prefix import PREFIX_SAMPLES

    meta = {"default_layer": 1, "default_pool": 3, "num_layers": 4, "hidden_size": 16}
    config = POISEConfig(output_dir=str(tmp_path), use_cpu=True, probe_granularity="prefix", probe_layer=1,
                         probe_pool_tokens=3)  # fmt: skip
    estimator = POISEEstimator.from_config(config, 4, 16)
    head = estimator.token_baseline_.probe  # the per-prefix head, unfitted
    settings = prefix_probe_settings(meta)
    assert settings == {
        "samples": PREFIX_SAMPLES,
        "pool_tokens": 3,
        "alpha": head.alpha,
        "pca_dims": list(estimator.token_baseline_.pca_dims),
        "clip": None if head.clip == "observed" else list(head.clip),
    }
