"""The per-prefix value (prefix.py): causality, the folded map against sklearn, and the hook against the features."""

import numpy as np
import pytest
import torch
from sklearn.compose import ColumnTransformer
from sklearn.decomposition import PCA
from sklearn.linear_model import Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from poise_trl.estimator.baselines import prefix_advantages
from poise_trl.features.features import capture_layer, find_decoder_layers
from poise_trl.features.prefix import (
    STATS,
    PrefixCapture,
    PrefixMap,
    feature_rows,
    feature_width,
    hidden_rows,
    prefix_pca_blocks,
    prefix_spans,
    prefix_stats,
)
from poise_trl.heads.heads import HEADS, make_head
from poise_trl.heads.probe import ValueProbe
from poise_trl.tiny import build_tiny_model, build_tiny_tokenizer

D, N_POOL = 128, 3


@pytest.fixture(scope="module")
def tiny():
    model = build_tiny_model(build_tiny_tokenizer(), num_layers=2, hidden_size=D, seed=0).eval()
    return model, find_decoder_layers(model)[0]


def _fit_probe(rows, targets, alpha=100.0, pca_dims=(0, 0), clip="observed", head="ridge") -> ValueProbe:
    """A prefix probe (the value head `head`) on (N, feature_width) rows, built as the per-prefix baseline builds
    it."""
    hidden_size = (rows.size(-1) - len(STATS)) // 2
    probe = make_head(head, alpha=alpha, pca_dims=prefix_pca_blocks(hidden_size, pca_dims) or None, clip=clip)
    return probe.fit(rows, targets)


AFFINE_HEADS = [name for name, head in HEADS.items() if callable(getattr(head, "affine", None))]
"""The heads the per-prefix value takes: those with an affine map."""


def _rows(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, feature_width(8), generator=g) * (torch.rand(feature_width(8), generator=g) * 3 + 0.5)
    y = (x[:, :3].sum(1) + x[:, -2] + torch.randn(n, generator=g) > 0).float()
    return x, y


@pytest.mark.parametrize("pca", [(0, 0), (3, 5)])
def test_folded_map_equals_sklearn_scaler_pca_ridge(pca):
    """The map the hook applies, x @ w + b, is the sklearn pipeline's prediction on the same feature rows."""
    x, y = _rows(200)
    probe = _fit_probe(x, y, alpha=10.0, pca_dims=pca, clip=None)
    steps = [StandardScaler()]
    if pca != (0, 0):
        blocks = [("p", PCA(pca[0], svd_solver="full"), list(range(8))), ("q", PCA(pca[1], svd_solver="full"),
                  list(range(8, 16)))]  # fmt: skip
        steps.append(ColumnTransformer(blocks, remainder="passthrough"))
    reference = make_pipeline(*steps, Ridge(alpha=10.0)).fit(x.double().numpy(), y.double().numpy())
    weight, bias = probe.affine()
    x_new, _ = _rows(50, seed=1)
    for points in (x, x_new):
        expected = reference.predict(points.double().numpy())
        folded = (points.double() @ weight + bias).numpy()
        assert np.abs(folded - expected).max() / np.abs(expected).max() < 1e-6


def _batch(model, prompts: list[list[int]], completions: list[list[int]]):
    """Left-padded prompts, right-padded completions, as TRL lays them out; masks and ids."""
    p, t = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.tensor([[0] * (p - len(x)) + x for x in prompts])
    prompt_mask = torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x in prompts])
    completion_ids = torch.tensor([y + [0] * (t - len(y)) for y in completions])
    completion_mask = torch.tensor([[1] * len(y) + [0] * (t - len(y)) for y in completions])
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _pass(model, layer, ids, prefix_map=None, samples=4, generated=None, seed=0):
    """One teacher-forced pass with the prefix capture: (feature rows, token values, spans, entropies)."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = ids
    spans = prefix_spans(prompt_mask, completion_mask, N_POOL, samples, generated, torch.Generator().manual_seed(seed))
    with torch.no_grad(), capture_layer(layer, PrefixCapture(spans, prefix_map)) as capture:
        logits = model(
            torch.cat([prompt_ids, completion_ids], 1), attention_mask=torch.cat([prompt_mask, completion_mask], 1)
        ).logits
    logits = logits[:, prompt_ids.size(1) - 1 : -1]  # the distribution that emitted each completion token
    entropies = -(logits.log_softmax(-1).exp() * logits.log_softmax(-1)).sum(-1)
    batch = capture.batch(entropies)
    rows, values = batch.rows, batch.values
    return rows, values, spans, entropies


def _fitted_map(model, layer, ids, head="ridge") -> tuple[PrefixMap, object]:
    rows, _, spans, _ = _pass(model, layer, ids, samples=6)
    flat = rows[spans.sampled]
    targets = flat[:, 0] + flat[:, D + 1] + flat[:, 2 * D]  # a value that reads every block
    probe = _fit_probe(flat, targets + 0.1 * torch.randn(len(targets)), alpha=1.0, clip=None, head=head)
    return PrefixMap.fold(probe, D), probe


def _example(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 40, (n,), generator=g).tolist() for n in (5, 9, 7)]
    completions = [torch.randint(3, 40, (n,), generator=g).tolist() for n in (12, 6, 9)]
    return prompts, completions


@pytest.mark.parametrize("head", AFFINE_HEADS)
def test_hook_values_equal_the_probe_on_every_tokens_features(tiny, head):
    """The hook's folded running means give what the probe, each head with an affine map, predicts from each token's
    full feature row."""
    model, layer = tiny
    prompts, completions = _example()
    ids = _batch(model, prompts, completions)
    prefix_map, probe = _fitted_map(model, layer, ids, head)
    _, values, spans, entropies = _pass(model, layer, ids, prefix_map)
    every = torch.arange(spans.generated.size(1)).expand(len(prompts), -1)
    with torch.no_grad():
        hidden = model(
            torch.cat([ids[0], ids[2]], 1), attention_mask=torch.cat([ids[1], ids[3]], 1), output_hidden_states=True
        ).hidden_states[1]
    rows = feature_rows(hidden_rows(hidden, spans, every), prefix_stats(entropies, spans), every)
    reference = probe.predict(rows.flatten(0, 1)).view_as(values)
    generated = spans.generated
    assert torch.allclose(values[generated], reference[generated], atol=1e-4, rtol=1e-4)


def test_baseline_of_token_t_reads_nothing_from_token_t_on(tiny):
    """Change token t and everything after it: the values applied to tokens 0..t stay, the next one moves."""
    model, layer = tiny
    prompts, completions = _example()
    ids = _batch(model, prompts, completions)
    prefix_map, _ = _fitted_map(model, layer, ids)
    _, before, *_ = _pass(model, layer, ids, prefix_map)
    for t in (0, 3, 5):
        changed = [y[:t] + [(c % 30) + 5 for c in y[t:]] for y in completions]
        _, after, *_ = _pass(model, layer, _batch(model, prompts, changed), prefix_map)
        torch.testing.assert_close(after[:, : t + 1], before[:, : t + 1], rtol=0, atol=1e-6)
        assert (after[:, t + 1] - before[:, t + 1]).abs().max() > 1e-4  # the test can see a leak of token t


@pytest.mark.parametrize("t", [0, 2, 5])
def test_no_column_of_token_t_reads_the_completions_length_or_what_follows(tiny, t):
    """Replace y_t on by completions of other lengths, ended by EOS (at t itself, or several tokens later): every
    STATS column, every feature row and the value of tokens 0..t stay as they were. (The fixed-length test above
    cannot see a statistic of the completion's length.)"""
    model, layer = tiny
    eos = build_tiny_tokenizer().eos_token_id
    prompts, completions = _example()
    ids = _batch(model, prompts, completions)
    prefix_map, _ = _fitted_map(model, layer, ids)
    _, before, spans, entropies = _pass(model, layer, ids, prefix_map)
    every = torch.arange(spans.generated.size(1)).expand(len(prompts), -1)

    def rows(ids, spans, entropies):
        with torch.no_grad():
            hidden = model(
                torch.cat([ids[0], ids[2]], 1),
                attention_mask=torch.cat([ids[1], ids[3]], 1),
                output_hidden_states=True,
            ).hidden_states[1]
        tokens = torch.arange(t + 1).expand(len(prompts), -1)
        return feature_rows(hidden_rows(hidden, spans, tokens), prefix_stats(entropies, spans), tokens)

    stats, full = prefix_stats(entropies, spans), rows(ids, spans, entropies)
    endings = ([eos], [(c % 30) + 5 for c in range(7 + t)] + [eos])  # shorter (EOS at t), longer
    for ending in endings:
        changed = [y[:t] + ending for y in completions]
        lengths = [len(y) for y in changed]
        assert lengths != [len(y) for y in completions]
        new_ids = _batch(model, prompts, changed)
        _, after, new_spans, new_entropies = _pass(model, layer, new_ids, prefix_map)
        new_stats = prefix_stats(new_entropies, new_spans)
        for column, name in enumerate(STATS):
            torch.testing.assert_close(
                new_stats[:, : t + 1, column], stats[:, : t + 1, column], rtol=0, atol=1e-5, msg=f"STATS {name!r}"
            )
        torch.testing.assert_close(rows(new_ids, new_spans, new_entropies), full, rtol=0, atol=1e-5)
        # float32 rounding moves with the padded width: a leak of the length moves a value by far more
        torch.testing.assert_close(after[:, : t + 1], before[:, : t + 1], rtol=0, atol=3e-5)
    assert every.size(1) == max(len(y) for y in completions)


def test_sampled_tokens_cover_the_generated_ones_evenly():
    """One sampled token per equal share of a row's generated tokens; none on padding or tool output."""
    completion_mask = torch.tensor([[1] * 8, [1] * 3 + [0] * 5, [0] * 8])
    tool = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1]] + [[1] * 8] * 2)
    spans = prefix_spans(torch.ones(3, 2), completion_mask, 2, 4, tool, torch.Generator().manual_seed(0))
    for _ in range(3):
        assert spans.generated.gather(1, spans.tokens)[:2].all()
    assert spans.sampled.tolist() == [[True] * 4, [True] * 4, [False] * 4]
    draws = torch.stack([prefix_spans(torch.ones(1, 2), torch.ones(1, 8), 2, 4).tokens[0] for _ in range(200)])
    for k in range(4):  # the k-th sample lies in the k-th quarter
        assert set(draws[:, k].tolist()) == {2 * k, 2 * k + 1}


def test_stats_read_only_earlier_entropies():
    spans = prefix_spans(torch.ones(1, 2), torch.ones(1, 5), 2, 1)
    entropies = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    stats = prefix_stats(entropies, spans)[0]
    assert stats.shape == (5, len(STATS))
    assert stats[:, 0].tolist() == [1.0, 1.5, 2.0, 2.5, 3.0]  # running mean up to the emitting distribution
    assert stats[:, 2].tolist() == [1.0, 1.5, 2.5, 3.5, 4.5]  # the last 2
    assert stats[:, 3].tolist() == [0, 1, 2, 3, 4]
    later = prefix_stats(torch.tensor([[1.0, 2.0, 3.0, 9.0, 9.0]]), spans)[0]
    assert torch.equal(later[:3], stats[:3])


def test_bad_inputs():
    with pytest.raises(ValueError, match="must both be >= 1"):
        prefix_spans(torch.ones(1, 2), torch.ones(1, 3), 0, 4)
    x, y = _rows(20)
    with pytest.raises(ValueError, match="inputs, not"):
        PrefixMap.fold(_fit_probe(x, y), 9)


def test_prefix_advantages_mask_and_fall_back():
    rewards = torch.tensor([1.0, 0.0, 1.0, float("nan")])
    values = torch.tensor([[0.5, 0.9, 7.0], [0.2, 0.4, 0.6], [0.5, float("nan"), 0.5], [0.1, 0.1, 0.1]])
    generated = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1], [1, 1, 1]])  # row 1's token 1: a tool result
    receives = torch.tensor([True, True, True, False])
    fallback = torch.tensor([0.3, -0.4, 0.25, 0.0])
    tokens, prefix = prefix_advantages(rewards, values, generated, receives, fallback)
    # row 2: the token whose value is NaN alone falls back to the sequence advantage; the others keep r - V
    expected = torch.tensor([[0.5, 0.1, 0.0], [-0.2, 0.0, -0.6], [0.5, 0.25, 0.5], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(tokens, expected)
    assert prefix.tolist() == [True, True, False, False]
    # token t's advantage depends on y_<t only: a non-finite value at a later token leaves the earlier ones alone
    later = values.clone()
    later[0, 1] = float("inf")
    moved, _ = prefix_advantages(rewards, later, generated, receives, fallback)
    assert moved[0, 0] == tokens[0, 0] and moved[0, 1] == fallback[0] and torch.equal(moved[1:], tokens[1:])


def test_token_baseline_keeps_the_exact_policy_gradient_when_eos_ends_completions_early():
    """The same exact expectation over completions of every length: token 3 is EOS, so a completion ends at its first
    EOS or after 3 tokens (40 completions of 1-3 tokens, their probabilities summing to 1), and the reward depends on
    the length. A baseline that reads the completion's length (decided by y_t and later tokens) biases the gradient:
    adding the length to any `STATS` column makes this test fail."""
    from itertools import product

    from .tiny_archs import causal_lm

    model = causal_lm("qwen3", vocab_size=4, hidden_size=16).double()
    layer = find_decoder_layers(model)[0]
    prompt, eos, most = [2, 1], 3, 3
    completions = [[eos]] + [[a, eos] for a in range(3)] + [[a, b, c] for a, b in product(range(3), repeat=2)
                                                            for c in range(4)]  # fmt: skip
    ids = _batch(model, [prompt] * len(completions), completions)
    mask = ids[3].double()
    rows, _, spans, _ = _pass(model, layer, ids, samples=most)
    reward = torch.tensor([0.4 * len(y) + float(y[0] == 0) for y in completions], dtype=torch.float64)
    flat = rows[spans.sampled]
    targets = reward.unsqueeze(1).expand(-1, most)[spans.sampled]
    probe = _fit_probe(flat, targets + 0.1 * torch.randn(len(flat)), alpha=1.0, clip=None)
    _, values, *_ = _pass(model, layer, ids, PrefixMap.fold(probe, 16))

    sequences = torch.cat([ids[0], ids[2]], dim=1)
    logits = model(sequences).logits[:, len(prompt) - 1 : -1]
    token_logps = logits.log_softmax(-1).gather(-1, ids[2].unsqueeze(-1)).squeeze(-1) * mask
    probability = token_logps.sum(1).exp()
    assert torch.isclose(probability.sum(), torch.tensor(1.0, dtype=torch.float64))
    parameters = list(model.parameters())

    def gradient(objective: torch.Tensor) -> torch.Tensor:
        return torch.cat([g.flatten() for g in torch.autograd.grad(objective, parameters, retain_graph=True)])

    exact = gradient((probability * reward).sum())
    weights = probability.detach().unsqueeze(1)
    baseline = torch.where(mask.bool(), values.double(), 0.0).detach()
    estimate = gradient((weights * (reward.unsqueeze(1) - baseline) * token_logps).sum())
    assert values.std() > 0.1 and (estimate - exact).norm() / exact.norm() < 1e-6
    leaked = torch.where(mask.bool(), torch.cat([values[:, 1:], values[:, -1:]], dim=1).double(), 0.0).detach()
    leak = gradient((weights * (reward.unsqueeze(1) - leaked) * token_logps).sum())
    assert (leak - exact).norm() / exact.norm() > 1e-2  # the test can see a value that read y_t


def test_token_baseline_keeps_the_exact_policy_gradient():
    """The expectation of sum_t (r - V(x, y_<t)) grad log pi(y_t | x, y_<t) is grad E[r], exactly, on a tiny model
    whose completions can all be enumerated (vocabulary 4, 3 tokens: 64 completions, so the mean over the policy is a
    sum, not a sample). Per-token weights are 1 (a sum over tokens): a weight 1/|y| that depends on the completion's
    length would make any baseline biased, since the length depends on y_t and the tokens after it. A value read from
    the state that has seen y_t (one position later) biases the gradient: the test can see a leak."""
    from itertools import product

    from .tiny_archs import causal_lm

    model = causal_lm("qwen3", vocab_size=4, hidden_size=16).double()
    layer = find_decoder_layers(model)[0]
    prompt, length = [2, 3], 3
    completions = [list(y) for y in product(range(4), repeat=length)]
    ids = _batch(model, [prompt] * len(completions), completions)
    rows, _, spans, _ = _pass(model, layer, ids, samples=length)
    reward = torch.tensor([float(y[0] == y[2]) + 0.3 * y[1] for y in completions], dtype=torch.float64)
    flat = rows[spans.sampled]
    probe = _fit_probe(flat, reward.repeat_interleave(length) + torch.randn(len(flat)), alpha=1.0, clip=None)
    _, values, *_ = _pass(model, layer, ids, PrefixMap.fold(probe, 16))
    assert values.std() > 0.1  # a baseline that moves along the completion

    sequences = torch.cat([ids[0], ids[2]], dim=1)
    logits = model(sequences).logits[:, len(prompt) - 1 : -1]
    token_logps = logits.log_softmax(-1).gather(-1, ids[2].unsqueeze(-1)).squeeze(-1)  # (64, 3)
    probability = token_logps.sum(1).exp()
    assert torch.isclose(probability.sum(), torch.tensor(1.0, dtype=torch.float64))
    parameters = list(model.parameters())

    def gradient(objective: torch.Tensor) -> torch.Tensor:
        return torch.cat([g.flatten() for g in torch.autograd.grad(objective, parameters, retain_graph=True)])

    exact = gradient((probability * reward).sum())  # grad E[r]
    weights = probability.detach().unsqueeze(1)

    def per_token(baseline: torch.Tensor) -> torch.Tensor:
        return gradient((weights * (reward.unsqueeze(1) - baseline.double()).detach() * token_logps).sum())

    error = (per_token(values) - exact).norm() / exact.norm()
    leaked = torch.cat([values[:, 1:], values[:, -1:]], dim=1)  # token t's value from the state after y_t
    leak = (per_token(leaked) - exact).norm() / exact.norm()
    assert error < 1e-6 and leak > 1e-2  # measured: 5e-8 (the model computes some parts in float32) and 0.96
