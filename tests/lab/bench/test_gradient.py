"""`poise-trl bench gradient`: the exact moments against brute-force Monte Carlo on a synthetic population with a
known true gradient, against enumeration of every group, their bootstrap intervals, and the command end to end."""

import itertools
import json

import numpy as np
import pytest
import torch

from poise_lab.bench.exact import (
    STD_EPS,
    PoolGram,
    bootstrap_counts,
    group_moments,
    oracle_moments,
    pair_moments,
    summarize,
    truth_weights,
)
from poise_lab.bench.gradient import (
    fitted_probe,
    measure,
    new_estimator,
    online_values,
    paired_rows,
    row_prompt_keys,
    run_estimator,
    separate_prompts,
    unstable_rules,
)
from poise_lab.bench.value.collect import Collection
from poise_trl import cli
from poise_trl.estimator.batch import Rollouts
from poise_trl.grpo.trainer import ESTIMATOR_FILE
from poise_trl.sampling import DEFAULT_FLOOR, importance_probabilities

TYPES, DIM = 12, 4
RNG = np.random.default_rng(0)
P_SUCCESS = np.concatenate([[0.0, 1.0, 0.05], RNG.uniform(0.1, 0.9, TYPES - 3)])  # prompts that always tie, too
DIRECTION = RNG.normal(size=(TYPES, DIM)) * np.linspace(1.5, 6, TYPES)[:, None]
TRUE_GRADIENT = (P_SUCCESS * (1 - P_SUCCESS))[:, None] * DIRECTION  # E[r g | x], g = (r - p) a_x + noise
G_TRUE = TRUE_GRADIENT.mean(0)


def _rollouts(types: np.ndarray, size: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Binary rewards, scores with E[g | x] = 0 whose reward-weighted mean is the prompt's true gradient, and a
    'probe value' of each rollout that depends on its own reward (it only ever serves its partner)."""
    p = P_SUCCESS[types][..., None]
    r = (rng.random(types.shape + (size,)) < p).astype(float)
    g = (r - p)[..., None] * DIRECTION[types][..., None, :] + rng.normal(size=r.shape + (DIM,))
    v = np.clip(0.6 * p + 0.3 * r + 0.1 * rng.normal(size=r.shape), 0, 1)
    return r, g, v


def _monte_carlo(rule: str, group: int, rng: np.random.Generator, n: int = 200_000, sampler=None) -> dict:
    """Fresh prompts and rollouts from the population: per-completion variance and the mean's dot with g."""
    if sampler is None:
        types, weight = rng.integers(TYPES, size=n), np.ones(n)
    else:
        q = sampler / sampler.sum()
        types = rng.choice(TYPES, size=n, p=q)
        weight = 1 / (TYPES * q[types])
    r, g, v = _rollouts(types, group, rng)
    if rule == "rloo":
        a = r - r[:, ::-1]
    elif rule == "poise":
        a = r - v[:, ::-1]
    elif rule == "oracle":
        a = r - P_SUCCESS[types][:, None]
    else:
        a = r - r.mean(1, keepdims=True)
        if rule != "noscale":
            a = a / (r.std(1, ddof=1, keepdims=True) + STD_EPS)
    y = (a[..., None] * g).sum(1) / group * weight[:, None]
    cost = group
    if rule == "dapo":  # only informative groups are kept; every group generated is charged
        keep = r.max(1) > r.min(1)
        y, cost = y[keep], group / keep.mean()
    mean = y.mean(0)
    return {"variance": cost * ((y**2).sum(1).mean() - mean @ mean), "mean_dot": mean @ G_TRUE}


@pytest.fixture(scope="module")
def synthetic_pool():
    rng = np.random.default_rng(1)
    types = np.repeat(np.arange(TYPES), 250)  # every prompt type equally often: the pool's mix adds no noise
    r, g, v = _rollouts(types, 12, rng)
    return types, r, v, g


def test_exact_moments_match_brute_force_monte_carlo(synthetic_pool):
    types, r, v, g = synthetic_pool
    pool = PoolGram(len(r), 12, scores=g.reshape(-1, DIM))
    counts, truth = bootstrap_counts(len(r), 0, 0), truth_weights(r)
    rules = {
        "grpo": (group_moments(r, 8, scale=True), 8),
        "noscale": (group_moments(r, 8, scale=False), 8),
        "dapo": (group_moments(r, 8, scale=True, informative_only=True), 8),
        "rloo": (pair_moments(r, r), 2),
        "poise": (pair_moments(r, v), 2),
        "oracle": (oracle_moments(r)[0], 2),
    }
    rng = np.random.default_rng(2)
    for name, (moments, group) in rules.items():
        exact = summarize(pool, moments, truth, counts)
        brute = _monte_carlo(name, group, rng)
        assert exact["variance"][0] == pytest.approx(brute["variance"], rel=0.02), name
        # E ĝ·g is a product over pairs of prompts: the pool's 3,000 prompts leave it a few % of noise
        assert exact["mean_dot"][0] == pytest.approx(brute["mean_dot"], rel=0.05), name
        if name in ("rloo", "poise", "oracle"):  # a baseline that never sees its rollout: unbiased, exactly
            assert abs(exact["bias2"][0]) < 1e-12 * exact["signal"][0]
    assert summarize(pool, rules["grpo"][0], truth, counts)["signal"][0] == pytest.approx(G_TRUE @ G_TRUE, rel=0.05)
    noscale = summarize(pool, rules["noscale"][0], truth, counts)  # its mean is exactly (G - 1) / G of g
    assert noscale["bias2"][0] == pytest.approx(noscale["signal"][0] / 64, rel=1e-9)
    score = np.sqrt(P_SUCCESS * (1 - P_SUCCESS)) + 0.1  # a prompt sampler q(x) ∝ score, weights 1 / (n q)
    sampled = summarize(pool, rules["poise"][0], truth, counts, sampler=score[types])
    brute = _monte_carlo("poise", 2, rng, sampler=score)
    assert sampled["variance"][0] == pytest.approx(brute["variance"], rel=0.02)
    assert sampled["variance"][0] < 0.9 * summarize(pool, rules["poise"][0], truth, counts)["variance"][0]


def test_group_second_moments_equal_the_average_over_every_group():
    """The hypergeometric closed form is the U-statistic over all G-subsets of a prompt's K rollouts."""
    rng = np.random.default_rng(3)
    k, group = 6, 4
    rewards = np.array([[1, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1.0]])
    scores = rng.normal(size=(3 * k, 5))
    pool = PoolGram(3, k, scores=scores)
    for scale in (True, False):
        moments = group_moments(rewards, group, scale)
        expected = []
        for x in range(3):
            values = []
            for subset in itertools.combinations(range(k), group):
                r = rewards[x, list(subset)]
                a = r - r.mean()
                a = a / (r.std(ddof=1) + STD_EPS) if scale else a
                y = (a[:, None] * scores[x * k + np.array(subset)]).sum(0) / group
                values.append(y @ y)
            expected.append(np.mean(values))
        assert pool.second(moments.second) == pytest.approx(expected, rel=1e-12)


def test_bootstrap_intervals_contain_their_estimates(synthetic_pool):
    types, r, v, g = synthetic_pool
    pick = np.arange(0, len(r), 25)  # 120 prompts of every type
    rewards, scores, values = r[pick], g[pick].reshape(-1, DIM), v[pick].ravel()
    grams = {"lora": torch.from_numpy(scores @ scores.T), "norms": torch.from_numpy(scores[:, :2] @ scores[:, :2].T)}
    rules = ["grpo8", "grpo8_noscale", "dapo_ds_carry", "rloo2", "poise_paper", "poise"]
    out = measure(rewards, {"poise": values, "poise_paper": values[::-1].copy()}, grams, rules, 300, 0)
    for block in out.values():
        cells = [c for row in block["table"].values() for c in row.values()]
        cells += [block[key] for key in ("signal_over_within", "between_over_within")]
        for cell in cells:
            low, high = cell["ci"]
            assert low <= cell["value"] <= high
        assert block["table"]["rloo2"]["share_rloo2"]["value"] == pytest.approx(1.0)
        assert abs(block["table"]["poise"]["bias2"]["value"]) < 1e-9


def test_bad_pools_are_refused_early():
    with pytest.raises(ValueError, match="binary rewards"):
        group_moments(np.full((2, 8), 0.5), 8, scale=True)
    with pytest.raises(ValueError, match="K=4"):
        group_moments(np.zeros((2, 4)), 8, scale=True)
    with pytest.raises(ValueError, match="K >= 3"):
        oracle_moments(np.zeros((2, 2)))


def parity_reward(completions: list[str], **kwargs) -> list[float]:
    """Binary and mixed within most prompts: the parity of the completion's character codes."""
    return [float(sum(map(ord, c)) % 2) for c in completions]


def test_command_end_to_end_on_the_tiny_model(tiny_model_path, tmp_path):
    out = tmp_path / "gradient"
    argv = ["bench", "gradient", str(tiny_model_path), "--dataset", "sort", "--num-prompts", "10", "--k", "8"]
    argv += ["--reward-fn", "tests.lab.bench.test_gradient:parity_reward", "--max-new-tokens", "6", "--device", "cpu"]
    argv += [
        "--pool-tokens",
        "3",
        "--bootstrap",
        "20",
        "--probe-prompts",
        "24",
        "--probe-heads",
        "logistic",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    argv += ["--output-dir", str(out)]
    assert cli.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["pool"]["prompts"] == 10 and results["pool"]["k"] == 8
    assert results["probes"]["poise"].startswith("fitted on a separate pool of 24 prompts x 2")
    for subspace in ("lora", "norms"):
        table = results["subspaces"][subspace]["table"]
        rows = {"grpo8", "grpo8_noscale", "dapo_ds_carry", "rloo2", "poise_paper", "poise", "oracle"}
        samplers = {"poise_sampler", "grpo8_sampler", "poise_probe_sampler", "grpo8_probe_sampler"}
        heads = {"poise_head_logistic", "poise_head_logistic_probe_sampler"}  # --probe-heads logistic
        assert set(table) == rows | samplers | heads
        logistic = "poise_head_logistic"
        for rule in (
            "rloo2",
            "poise",
            "oracle",
            "poise_sampler",
            "poise_probe_sampler",
            logistic,
            f"{logistic}_probe_sampler",
        ):
            assert abs(table[rule]["bias2"]["value"]) < 1e-9  # a sampler's 1 / (n q) weights keep the mean
        assert table[logistic]["variance"]["value"] != pytest.approx(table["poise"]["variance"]["value"])
        # the head's difference to ridge over the same resamples: its point is the difference of the two rows
        difference = results["subspaces"][subspace]["paired"][f"{logistic} - poise"]
        assert difference["value"] == pytest.approx(
            table[logistic]["variance"]["value"] - table["poise"]["variance"]["value"]
        )
        assert difference["ci"][0] <= difference["ci"][1]
        for rule in ("poise", "grpo8", logistic):  # the probe's q is not uniform, so the sampled row's variance moves
            sampled, plain = (table[r]["variance"]["value"] for r in (f"{rule}_probe_sampler", rule))
            assert sampled != pytest.approx(plain)
        assert table["grpo8"]["share_grpo8"]["value"] == pytest.approx(1.0)
        # no std scaling: the mean is exactly 7/8 of g, so its scale-matched variance is its variance x (8/7)²
        noscale = table["grpo8_noscale"]
        assert noscale["share_grpo8_noscale"]["value"] == pytest.approx(1.0)
        assert noscale["matched_variance"]["value"] == pytest.approx(noscale["variance"]["value"] * (8 / 7) ** 2)
    assert "POISE (default) + probe sampler G=2" in (out / "results.md").read_text()
    assert "POISE (default) [logistic] + probe sampler G=2" in (out / "results.md").read_text()
    assert results["probes"][logistic].startswith("fitted on a separate pool of 24 prompts x 2")
    assert (out / "gradient.png").stat().st_size > 0
    first = (out / "results.md").read_text()
    assert "Share of GRPO G=8" in first and "Bv/W" in first
    assert cli.main(argv) == 0  # the second run reads the pool from the cache
    assert json.loads((out / "results.json").read_text())["subspaces"] == results["subspaces"]

    # a trained snapshot's folder that holds its run's saved estimator: POISE (default) uses it
    folder = next((tmp_path / "cache" / "gradient").iterdir())
    pool, probe = Collection.load(folder / "pool.safetensors"), Collection.load(folder / "probe_pool.safetensors")
    keep = separate_prompts(pool, probe, 24)
    saved, blocks = fitted_probe("poise", pool, probe, keep[:20])  # another probe than the 24-prompt fit
    saved.save(tmp_path / ESTIMATOR_FILE)
    fresh, _, fresh_q = online_values(pool, probe, keep)
    pool.meta["model_path"] = str(tmp_path)
    values, sources, samplers = online_values(pool, probe, keep)
    q, fresh_q = samplers["poise"], fresh_q["poise"]
    assert sources["poise"] == f"the run's saved estimator ({ESTIMATOR_FILE})"
    assert sources["poise_paper"].startswith("fitted on a separate pool")
    _, refit_sources, _ = online_values(pool, probe, keep, heads=["logistic"])  # a run without history: no extra rows
    assert set(refit_sources) == {"poise_paper", "poise", "poise_head_logistic"}
    assert (
        refit_sources["poise_head_logistic"]
        == "the run's saved estimator refit with the logistic head on its own buffer"
    )
    features = pool.columns(blocks, int(pool.meta["default_layer"]), int(pool.meta["default_pool"]))
    expected = saved.advantages(features, Rollouts(pool.rewards.nan_to_num(0.0))).values.double().numpy()
    assert np.array_equal(values["poise"], expected) and not np.allclose(values["poise"], fresh["poise"])
    # the probe sampler is the saved estimator's: its prompt-only probe on each prompt's prompt block, floored
    layer, width = int(pool.meta["default_layer"]), int(pool.meta["default_pool"])
    prompts = pool.columns(["prompt"], layer, width)[:: pool.k]
    low, high = (float(b) for b in saved.target_range())
    expected_q = importance_probabilities(saved.prompt_values(prompts), low, high, DEFAULT_FLOOR).numpy()
    assert np.allclose(q, expected_q) and not np.allclose(q, fresh_q)
    assert q.sum() == pytest.approx(1.0) and q.min() >= DEFAULT_FLOOR / pool.num_prompts - 1e-12

    # a run that kept a prompt history: its estimator reads each measured prompt's earlier rewards by its id, and
    # every head is measured again without them, refit on the same buffered rows less the history columns
    keys = row_prompt_keys(pool)
    assert keys.unique().numel() == pool.num_prompts  # the trainer's ids, kept with the pool
    run, blocks = new_estimator("poise", pool, history=True)
    probe_keys = row_prompt_keys(probe)
    for chunk in [*np.array_split(keep, run.spec.buffer.warmup_steps), *np.array_split(keep, 4)]:  # two epochs
        rows = torch.from_numpy((chunk[:, None] * 2 + np.arange(2)).ravel())
        record = Rollouts(probe.rewards[rows].nan_to_num(0.0), prompt_ids=probe_keys[rows])
        run.observe(features=probe.columns(blocks, layer, width)[rows], rollouts=record)
    earlier = torch.arange(pool.rewards.numel()) % pool.k < 2  # an earlier step's rewards of the measured prompts
    earlier_rows = Rollouts(pool.rewards[earlier].nan_to_num(0.0), prompt_ids=keys[earlier])
    run.observe(features=features[earlier], rollouts=earlier_rows)
    run.save(tmp_path / ESTIMATOR_FILE)
    values, sources, samplers = online_values(pool, probe, keep, heads=["logistic"])
    assert set(values) == {"poise_paper", "poise", *(f"poise_head_{h}" for h in ("ridge_nohistory", "logistic"))} | {
        "poise_head_logistic_nohistory"
    }
    assert set(samplers) == set(values) - {"poise_paper"}
    assert sources["poise_head_ridge_nohistory"].endswith(
        "refit with the ridge head on its own buffer, without the prompt history"
    )
    expected = run.predict(features, Rollouts(pool.rewards.nan_to_num(0.0), prompt_ids=keys)).double().numpy()
    assert np.array_equal(values["poise"], expected)
    bare, _ = run_estimator(tmp_path / ESTIMATOR_FILE, pool, "ridge", history=False)
    assert bare.prompt_history_ is None and bare.row.appended == 1  # the partner's reward only
    width_saved = run.probes_["default"].buffer.features.size(-1)
    assert bare.probes_["default"].buffer.features.size(-1) == width_saved - 3
    assert len(bare.probes_["default"].buffer) == len(run.probes_["default"].buffer)
    assert not np.allclose(values["poise_head_ridge_nohistory"], values["poise"])
    rows = ["poise", "poise_head_ridge_nohistory", "poise_head_logistic", "poise_head_logistic_nohistory"]
    assert paired_rows([*rows, "poise_head_logistic_probe_sampler"]) == [
        ("poise_head_logistic", "poise"),
        ("poise_head_logistic", "poise_head_logistic_nohistory"),
        ("poise_head_logistic_nohistory", "poise_head_ridge_nohistory"),
        ("poise", "poise_head_ridge_nohistory"),
    ]
    with pytest.raises(SystemExit, match="delete its cache folder"):
        row_prompt_keys(
            Collection(**{**vars(pool), "meta": {k: v for k, v in pool.meta.items() if k != "prompt_keys"}})
        )


def test_a_bad_sampler_floor_is_refused_before_sampling(tmp_path, capsys):
    argv = ["bench", "gradient", str(tmp_path / "no-model"), "--prompt-selection-floor", "0"]
    assert cli.main(argv + ["--cache-dir", str(tmp_path), "--output-dir", str(tmp_path / "out")]) != 0
    assert "prompt_selection_floor=0.0 must be in (0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "gradient").exists()  # refused before any pool was sampled


def test_unstable_scale_matching_is_named_in_the_report():
    steady = {"value": 2.0, "ci": [1.5, 2.8]}
    table = {"grpo8": {"matched_variance": {"value": 71.2, "ci": [0.1, 55.6]}}, "rloo2": {"matched_variance": steady}}
    assert unstable_rules(table) == ["grpo8"]
    assert unstable_rules({"rloo2": {"matched_variance": steady}}) == []
