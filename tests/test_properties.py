"""Property tests (hypothesis) for the pure modules: NaN safety of baselines and advantages, span and pooling
arithmetic against a brute-force oracle, and a probe that always predicts finite values in its clip range.

Why: the trainer feeds these functions truncated completions, reward functions that return None, non-finite
features and groups where partners are missing. One NaN that leaks into an advantage poisons the whole update.
"""

import math

import hypothesis.extra.numpy as hnp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poise_trl.estimator.baselines import (
    DIAGNOSTICS,
    cross_rollout_baselines,
    diagnostic_tensors,
    leave_one_out_targets,
)
from poise_trl.estimator.buffer import ProbeBuffer
from poise_trl.features.columns import DEFAULT_SCALARS, SCALARS, scalar_columns
from poise_trl.features.features import (
    FEATURE_BLOCKS,
    FeatureLayout,
    feature_spans,
    find_last_subsequence,
    pool_hidden,
)
from poise_trl.heads.probe import ValueProbe

from .test_columns import TOKENIZER, assert_matches_reference

NAN, INF = float("nan"), float("inf")
SETTINGS = settings(max_examples=80, deadline=None, derandomize=True)

finite_small = st.floats(-10, 10, width=32)
non_finite = st.sampled_from([NAN, INF, -INF])
# Mostly finite, with NaN and ±inf injected (one_of picks a branch uniformly, so about one value in four).
maybe_finite = st.one_of(finite_small, finite_small, finite_small, non_finite)


@st.composite
def grouped(draw, elements=maybe_finite, max_groups: int = 5) -> tuple[int, torch.Tensor]:
    """(G, values) with G in [2, 5] and whole groups of G consecutive rows."""
    group = draw(st.integers(2, 5))
    n = group * draw(st.integers(1, max_groups))
    return group, torch.tensor(draw(st.lists(elements, min_size=n, max_size=n)), dtype=torch.float32)


def _mean_of_others_oracle(values: torch.Tensor, group: int, valid: torch.Tensor) -> list[float]:
    """Plain-Python mean over the valid, finite other rows of each row's group; NaN when there are none."""
    out = []
    for i in range(values.numel()):
        start = i - i % group
        partners = [
            float(values[j]) for j in range(start, start + group) if j != i and valid[j] and math.isfinite(values[j])
        ]
        out.append(math.fsum(partners) / len(partners) if partners else NAN)
    return out


# ------------------------------------------------------------------------------------------------------ baselines
@SETTINGS
@given(grouped(), st.one_of(st.none(), st.lists(st.booleans(), min_size=25, max_size=25)))
def test_mean_of_others_is_nan_exactly_without_a_valid_finite_partner(case, valid_bits):
    """Both public functions: finite (and equal to the partners' mean) iff a valid finite partner exists."""
    group, values = case
    valid = None if valid_bits is None else torch.tensor(valid_bits[: values.numel()])
    everyone = torch.ones_like(values, dtype=torch.bool)
    oracle = _mean_of_others_oracle(values, group, everyone if valid is None else valid)
    for fn in (cross_rollout_baselines, leave_one_out_targets):
        out = fn(values, group, valid)
        assert out.shape == values.shape and out.dtype == values.dtype
        for got, want in zip(out.tolist(), oracle, strict=True):
            if math.isnan(want):
                assert math.isnan(got)
            else:  # sum-minus-self in float32: allow rounding relative to the group's magnitudes (<= 10 here)
                assert math.isfinite(got) and abs(got - want) <= 1e-5


@SETTINGS
@given(grouped(elements=finite_small), st.data())
def test_baseline_of_a_row_never_depends_on_that_row(case, data):
    """The unbiasedness condition of §2.2 as a structural property: row i's value and validity leave b_i unchanged."""
    group, values = case
    valid = torch.tensor(data.draw(st.lists(st.booleans(), min_size=values.numel(), max_size=values.numel())))
    i = data.draw(st.integers(0, values.numel() - 1))
    before = cross_rollout_baselines(values, group, valid)[i]
    changed, flipped = values.clone(), valid.clone()
    changed[i] = data.draw(maybe_finite)
    flipped[i] = not flipped[i]
    after = cross_rollout_baselines(changed, group, flipped)[i]
    # Up to float32 rounding: the library computes (group sum − own value), so the own value moves the last bits.
    assert (math.isnan(before) and math.isnan(after)) or abs(before - after) <= 1e-5


def trainer_advantages(
    rewards_per_func: torch.Tensor,
    reward_weights: torch.Tensor,
    values: torch.Tensor,
    features: torch.Tensor,
    has_completion: torch.Tensor,
    num_generations: int,
    bootstrap: bool,
    scale_batch: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The advantage rule of `POISETrainer._generate_and_score_completions`, line for line (there is no pure helper
    in the library to call). Returns (advantages, baselines, receives)."""
    feature_ok = has_completion & torch.isfinite(features).all(1)
    rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(1)
    rewards[torch.isnan(rewards_per_func).all(1) | ~torch.isfinite(rewards)] = torch.nan
    scorable = torch.isfinite(rewards)
    rloo = leave_one_out_targets(rewards, num_generations, scorable)
    baselines = rloo
    if not bootstrap:
        probe_baselines = cross_rollout_baselines(values, num_generations, feature_ok)
        baselines = torch.where(torch.isnan(probe_baselines), rloo, probe_baselines)
    receives = scorable & has_completion & torch.isfinite(baselines)
    advantages = torch.where(receives, rewards - baselines, torch.zeros_like(rewards))
    if scale_batch and scorable.sum() > 1:
        advantages = advantages / (rewards[scorable].std() + 1e-4)
    return advantages, baselines, receives


@st.composite
def trainer_batches(draw) -> dict:
    """Gathered tensors as the trainer sees them, with None rewards (NaN), ±inf, empty completions, bad features."""
    group = draw(st.integers(2, 5))
    n = group * draw(st.integers(1, 4))
    funcs = draw(st.integers(1, 3))
    dim = draw(st.integers(1, 3))

    def tensor(shape: tuple[int, ...], elements=maybe_finite) -> torch.Tensor:
        flat = draw(st.lists(elements, min_size=math.prod(shape), max_size=math.prod(shape)))
        return torch.tensor(flat, dtype=torch.float32).reshape(shape)

    return dict(
        rewards_per_func=tensor((n, funcs)),
        reward_weights=tensor((funcs,), st.floats(0, 2, width=32)),
        values=tensor((n,), st.one_of(st.floats(0, 1, width=32), non_finite)),
        features=tensor((n, dim)),
        has_completion=torch.tensor(
            draw(st.lists(st.sampled_from([True, True, True, False]), min_size=n, max_size=n))
        ),
        num_generations=group,
        bootstrap=draw(st.booleans()),
        scale_batch=draw(st.booleans()),
    )


@SETTINGS
@given(trainer_batches())
def test_trainer_advantages_are_always_finite(batch):
    """Whatever is missing or non-finite, every advantage is a finite number, and exactly the rows that have a
    finite reward, a completion and some usable partner receive r − b."""
    advantages, baselines, receives = trainer_advantages(**batch)
    assert torch.isfinite(advantages).all()

    group = batch["num_generations"]
    rpf, weights = batch["rewards_per_func"], batch["reward_weights"]
    rewards = (rpf * weights).nansum(1)
    scorable = torch.isfinite(rewards) & ~torch.isnan(rpf).all(1)
    feature_ok = batch["has_completion"] & torch.isfinite(batch["features"]).all(1) & torch.isfinite(batch["values"])
    for i in range(rewards.numel()):
        partners = [j for j in range(i - i % group, i - i % group + group) if j != i]
        has_baseline = any(scorable[j] for j in partners) or (
            not batch["bootstrap"] and any(feature_ok[j] for j in partners)
        )
        assert bool(receives[i]) == bool(scorable[i] and batch["has_completion"][i] and has_baseline), i
        if not receives[i]:
            assert advantages[i] == 0
        elif not batch["scale_batch"]:
            assert advantages[i] == rewards[i] - baselines[i]


@SETTINGS
@given(trainer_batches(), st.data())
def test_trainer_advantage_of_a_row_ignores_its_own_features_and_value(batch, data):
    """Replacing row i's features and probe value (even by NaN) never changes A_i: the baseline is cross-rollout.

    Compared unscaled and up to float32 rounding: the library's (group sum − own value) moves the last bits.
    """
    batch["scale_batch"] = False
    i = data.draw(st.integers(0, batch["values"].numel() - 1))
    before, _, received = trainer_advantages(**batch)
    batch["values"] = batch["values"].clone()
    batch["features"] = batch["features"].clone()
    batch["values"][i] = data.draw(st.one_of(st.floats(0, 1, width=32), non_finite))
    batch["features"][i] = data.draw(maybe_finite)
    after, _, receives = trainer_advantages(**batch)
    assert receives[i] == received[i] and abs(after[i] - before[i]) <= 1e-6


# ------------------------------------------------------------------------------------------------------- features
@st.composite
def span_batches(draw) -> dict:
    """Prompts left- or right-padded, right-padded completions (some empty), a marker that may or may not occur, and
    possibly a generated mask with gaps (tool results) that can cut a marker in two."""
    batch = draw(st.integers(1, 5))
    prompt_width, completion_width = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    vocab = 4
    marker = draw(st.one_of(st.none(), st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3)))
    prompt_left = draw(st.booleans())
    prompt_mask = torch.zeros(batch, prompt_width)
    completion_mask = torch.zeros(batch, completion_width)
    completion_ids = torch.zeros(batch, completion_width, dtype=torch.long)
    for row in range(batch):
        p_len = draw(st.integers(0, prompt_width))
        if prompt_left:
            prompt_mask[row, prompt_width - p_len :] = 1
        else:
            prompt_mask[row, :p_len] = 1
        c_len = draw(st.integers(0, completion_width))
        completion_mask[row, :c_len] = 1
        ids = draw(st.lists(st.integers(0, vocab - 1), min_size=completion_width, max_size=completion_width))
        if marker and c_len >= len(marker) and draw(st.booleans()):  # plant the marker inside the valid tokens
            at = draw(st.integers(0, c_len - len(marker)))
            ids[at : at + len(marker)] = marker
        completion_ids[row] = torch.tensor(ids)
    generated_mask = None
    if draw(st.booleans()):
        bits = draw(st.lists(st.booleans(), min_size=batch * completion_width, max_size=batch * completion_width))
        generated_mask = torch.tensor(bits).view(batch, completion_width).long()
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    hidden_size = draw(st.integers(1, 4))
    entropies = torch.rand(batch, completion_width, generator=g) * 3
    bad = torch.rand(batch, completion_width, generator=g) < 0.2  # NaN/±inf entropies, even on valid tokens
    entropies[bad] = torch.tensor([NAN, INF, -INF])[torch.randint(3, (int(bad.sum()),), generator=g)]
    return dict(
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        generated_mask=generated_mask,
        pool_tokens=draw(st.integers(1, 5)),
        marker=marker,
        hidden=torch.randn(batch, prompt_width + completion_width, hidden_size, generator=g) * 10,
        entropies=entropies,
    )


def _last_marker_end(ids: list[int], generated: list[int], marker: list[int] | None) -> int:
    """End of the last marker whose every token the policy generated."""
    if not marker:
        return -1
    m = len(marker)
    whole = [e for e in generated if set(range(e - m + 1, e + 1)) <= set(generated)]
    ends = [e for e in whole if ids[e - m + 1 : e + 1] == marker]
    return ends[-1] if ends else -1


def _mean_rows(hidden: torch.Tensor, positions: list[int]) -> torch.Tensor:
    if not positions:
        return torch.zeros(hidden.size(-1))
    return hidden[positions].double().mean(0).float()


def _mean_values(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@SETTINGS
@given(span_batches())
def test_spans_pooling_and_entropy_match_a_brute_force_oracle(case):
    """feature_spans + pool_hidden + every rollout scalar equal a per-row list computation (the scalars: the official
    code's formulas, test_columns.py), and are finite, for empty
    prompts, empty completions, markers at any position or absent, tokens the policy did not generate, and NaN/±inf
    entropies (counted as 0)."""
    n = case["pool_tokens"]
    generated_mask = case["generated_mask"]
    spans = feature_spans(
        case["prompt_mask"],
        case["completion_ids"],
        case["completion_mask"],
        n,
        case["marker"],
        generated_mask,
        TOKENIZER,
    )
    pooled = pool_hidden(case["hidden"], spans.pool_index, spans.pool_weight)
    stats = scalar_columns(DEFAULT_SCALARS, case["entropies"], spans)
    features = FeatureLayout(FEATURE_BLOCKS).assemble(pooled, case["entropies"], spans)
    assert_matches_reference(scalar_columns(list(SCALARS), case["entropies"], spans), case["entropies"], spans)
    batch, prompt_width = case["prompt_mask"].shape
    hidden_size = case["hidden"].size(-1)
    assert pooled.shape == (batch, 2, hidden_size) and stats.shape == (batch, 3)
    assert features.shape == (batch, 2 * hidden_size + 4) and torch.isfinite(features).all()

    entropies = case["entropies"].nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    valid = case["completion_mask"] if generated_mask is None else case["completion_mask"] * generated_mask
    marker_ends = find_last_subsequence(case["completion_ids"], valid, case["marker"] or [])
    for row in range(batch):
        prompt_positions = [p for p in range(prompt_width) if case["prompt_mask"][row, p]]
        generated = [
            p
            for p in range(int(case["completion_mask"][row].sum()))
            if generated_mask is None or generated_mask[row, p]
        ]
        length = len(generated)
        ids = case["completion_ids"][row].tolist()
        end = _last_marker_end(ids, generated, case["marker"])
        assert int(marker_ends[row]) == end
        reasoning = [p for p in generated if p <= end] if end >= 0 else generated
        answer = [p for p in generated if p > end] if end >= 0 else generated[-n:] if length else []
        expected_prompt = _mean_rows(case["hidden"][row], prompt_positions[-n:])
        expected_reasoning = _mean_rows(case["hidden"][row], [prompt_width + p for p in reasoning[-n:]])
        torch.testing.assert_close(pooled[row, 0], expected_prompt, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pooled[row, 1], expected_reasoning, rtol=1e-5, atol=1e-5)
        row_entropy = entropies[row].tolist()
        expected_stats = [_mean_values([row_entropy[p] for p in span]) for span in (generated, reasoning, answer)]
        torch.testing.assert_close(stats[row], torch.tensor(expected_stats), rtol=1e-5, atol=1e-5)
        assert features[row, -1] == length


# ---------------------------------------------------------------------------------------------------------- probe
@st.composite
def probe_data(draw) -> dict:
    """Finite training data with constant columns, duplicate rows and N < D allowed, plus fresh finite inputs."""
    n, d = draw(st.integers(2, 24)), draw(st.integers(1, 30))
    element = st.floats(-1e4, 1e4, allow_subnormal=False)
    x = torch.tensor(draw(hnp.arrays("float64", (n, d), elements=element)))
    for column in draw(st.lists(st.integers(0, d - 1), max_size=d)):
        x[:, column] = draw(element)  # a constant column (StandardScaler must not divide by zero)
    for target, source in draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=n)):
        x[target] = x[source]  # duplicate rows
    y = torch.tensor(draw(st.lists(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0, 1)), min_size=n, max_size=n)))
    pca = draw(
        st.one_of(
            st.none(),
            st.integers(1, 6),
            st.builds(lambda k, stop: [(0, stop, k)], st.integers(1, 6), st.integers(1, d)),
        )
    )
    return dict(
        x=x.float(),
        y=y.float(),
        x_new=torch.tensor(draw(hnp.arrays("float64", (5, d), elements=element))).float(),
        alpha=draw(st.sampled_from([1e-3, 0.01, 1.0, 100.0])),
        pca=pca,
        clip=draw(st.sampled_from([(0.0, 1.0), (-1.0, 2.0), "observed", None])),
    )


@SETTINGS
@given(probe_data())
def test_probe_predictions_are_finite_and_clipped(case):
    probe = ValueProbe(alpha=case["alpha"], pca_dims=case["pca"], clip=case["clip"]).fit(case["x"], case["y"])
    if case["clip"] == "observed":
        low, high = case["y"].min().item(), case["y"].max().item()
    else:
        low, high = case["clip"] or (-INF, INF)
    for x in (case["x"], case["x_new"]):
        predictions, raw = probe.predict(x, return_unclipped=True)
        assert predictions.shape == (x.size(0),) and predictions.dtype == torch.float32
        assert torch.isfinite(predictions).all() and torch.isfinite(raw).all()
        assert ((predictions >= low) & (predictions <= high)).all()
        assert torch.equal(predictions, raw.clamp(low, high))


@SETTINGS
@given(st.integers(1, 10), st.lists(st.integers(0, 6), max_size=8))
def test_probe_buffer_keeps_the_newest_rows_in_order(capacity, batch_sizes):
    buffer, seen = ProbeBuffer(capacity), []
    for size in batch_sizes:
        rows = torch.arange(len(seen), len(seen) + size, dtype=torch.float32)
        buffer.add(rows.unsqueeze(1).repeat(1, 3), rows)
        seen += rows.tolist()
    assert len(buffer) == min(capacity, len(seen))
    if seen:
        assert buffer.targets.tolist() == seen[-capacity:]
        assert buffer.features[:, 2].tolist() == seen[-capacity:]


@SETTINGS
@given(grouped(), st.data())
def test_diagnostics_never_raise_and_stay_in_range(case, data):
    """Diagnostics on partly missing data: defined keys are finite and in range, undefined ones NaN, never an error."""
    group, rewards = case
    n = rewards.numel()
    values = torch.tensor(data.draw(st.lists(maybe_finite, min_size=n, max_size=n)))
    valid = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    stats = diagnostic_tensors(rewards, cross_rollout_baselines(values, group, valid), values, group, valid)
    out = dict(zip(DIAGNOSTICS, stats.tolist(), strict=True))
    assert all(isinstance(v, float) for v in out.values())
    assert not any(math.isinf(v) for v in out.values())
    for key in ("sign_accuracy", "clip_fraction"):
        assert math.isnan(out[key]) or 0 <= out[key] <= 1
    assert math.isnan(out["pearson_r"]) or abs(out["pearson_r"]) <= 1 + 1e-9
    assert math.isnan(out["mae"]) or out["mae"] >= 0
    for key in ("brier_skill", "variance_reduction"):
        assert math.isnan(out[key]) or out[key] <= 1 + 1e-9
