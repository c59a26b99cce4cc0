"""The granularity table: both token baselines answer the same calls; "sequence" adds nothing per token, "prefix"
learns V(x, y_<t) with an OnlineLearner whose head is sized once the rows tell the model's width."""

import pytest
import torch

from poise_trl.estimator.granularity import GRANULARITIES, PrefixBaseline, SequenceBaseline
from poise_trl.estimator.specs import HeadSpec
from poise_trl.features.prefix import STATS, PrefixBatch, feature_width

D = 6  # hidden size of the made-up rows
RIDGE = HeadSpec(alpha=1.0).build  # the per-prefix head for some PCA blocks


def _batch(n: int = 4, k: int = 4, t: int = 5, seed: int = 0, values: bool = False) -> PrefixBatch:
    g = torch.Generator().manual_seed(seed)
    return PrefixBatch(
        rows=torch.randn(n, k, feature_width(D), generator=g),
        sampled=torch.ones(n, k, dtype=torch.bool),
        values=torch.rand(n, t, generator=g) if values else None,
        generated=torch.ones(n, t, dtype=torch.bool),
        tokens=torch.arange(k).expand(n, -1),
    )


@pytest.mark.parametrize("name", list(GRANULARITIES))
def test_every_entry_has_its_name_and_the_same_calls_and_adds_nothing_without_a_capture(name):
    """Every granularity answers the calls the estimator and the trainer make, whichever it is: built with an
    estimator's settings, with no token capture it changes no advantage, learns nothing and round-trips its state."""
    entry = GRANULARITIES[name]
    calls = ("capturer", "advantages", "diagnostics", "host_metrics", "observed", "fitted", "state_dict", "info")
    assert entry.name == name
    for call in (*calls, "loaded"):
        assert callable(getattr(entry, call)), (name, call)
    assert isinstance(entry.takes_history, bool) and isinstance(entry.one_layer, bool)
    assert all(isinstance(method, str) for method in entry.head_methods)
    built = entry(head=RIDGE, pca_dims=(0, 0), buffer_size=64, warmup_steps=1)
    rewards, receives = torch.rand(4), torch.ones(4, dtype=torch.bool)
    assert built.advantages(None, rewards, receives, rewards) is None
    assert built.diagnostics(None, rewards, receives, None) == {}
    assert built.observed(None, rewards, receives) is built  # without a capture it learns nothing
    assert built.fitted(None) == (built, False)  # and has nothing to refit
    state, info = built.state_dict(), built.info()
    again = entry(head=RIDGE, pca_dims=(0, 0), buffer_size=64, warmup_steps=1)
    again = again.loaded(state, info or {}, warm_start=False)
    assert again.state_dict().keys() == state.keys() and isinstance(built.host_metrics(), dict)


def test_the_sequence_granularity_adds_nothing_per_token():
    sequence = SequenceBaseline(head=RIDGE, pca_dims=(2, 2))
    rewards, receives = torch.rand(4), torch.ones(4, dtype=torch.bool)
    assert sequence.capturer(torch.ones(4, 3), torch.ones(4, 5), None, 2, torch.Generator()) is None
    assert sequence.advantages(None, rewards, receives, rewards) is None and sequence.diagnostics(None) == {}
    assert not sequence.fitted(None)[1] and sequence.learners == () and sequence.info() is None


def test_the_prefix_head_is_sized_by_the_first_rows_and_refits_only_after_a_capture():
    prefix = PrefixBaseline(RIDGE, pca_dims=(2, 3), warmup_steps=1)
    assert prefix.probe.pca_dims is None and not prefix.trusted and prefix.map() is None
    rewards, keep = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([True, True, True, False])
    observed = prefix.observed(_batch(), rewards, keep)
    assert prefix.probe.pca_dims is None and len(prefix.buffer) == 0  # a value: observing built a new baseline
    prefix = observed
    assert prefix.probe.pca_dims == [(0, D, 2), (D, 2 * D, 3)]
    assert len(prefix.buffer) == 12 and prefix.buffer.features.shape[1:] == (1, feature_width(D))
    assert prefix.fitted(None) == (prefix, False)
    prefix, refitted = prefix.fitted(_batch())
    assert refitted and prefix.trusted and prefix.map().stats.shape == (len(STATS),)
    tokens = prefix.advantages(_batch(values=True), rewards, keep, torch.zeros(4))
    assert tokens.advantages.shape == (4, 5) and tokens.used.tolist() == [True, True, True, False]
    assert prefix.advantages(None, rewards, keep, torch.zeros(4)) is None


def test_the_prefix_state_round_trips_and_sizes_the_head_from_the_file():
    prefix = PrefixBaseline(RIDGE, pca_dims=(2, 3), warmup_steps=1)
    prefix, _ = prefix.observed(_batch(), torch.rand(4), torch.ones(4, dtype=torch.bool)).fitted(_batch())
    resumed = PrefixBaseline(RIDGE, pca_dims=(2, 3), warmup_steps=1).loaded(prefix.state_dict(), prefix.info())
    assert resumed.probe.pca_dims == prefix.probe.pca_dims and resumed.trusted
    rows = _batch(seed=3).rows.flatten(0, 1)
    assert torch.equal(resumed.probe.predict(rows), prefix.probe.predict(rows))
    fresh = PrefixBaseline(RIDGE, pca_dims=(2, 3)).loaded({}, {})  # a sequence-level run's file: it starts afresh
    assert not fresh.probe.is_fitted and len(fresh.buffer) == 0
