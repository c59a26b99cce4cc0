"""Conformance of every registry's entries, one check per entry, in the style of scikit-learn's `check_estimator`:
a new value head, granularity, sampling rule, bootstrap, reward scaling, schedule, domain routing or rollout scalar is
checked by these tests as it is added, with no test to edit. Each table holds the names the command lines offer
(choices.py), in order; the value heads' own checks are test_heads.py's, over every head too."""

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

from poise_trl import choices
from poise_trl.estimator.baselines import BOOTSTRAPS, REWARD_SCALINGS, RunningStd, leave_one_out_targets
from poise_trl.estimator.batch import Rollouts
from poise_trl.estimator.domains import ROUTINGS
from poise_trl.estimator.estimator import POISEEstimator
from poise_trl.estimator.granularity import GRANULARITIES
from poise_trl.estimator.schedule import SCHEDULES
from poise_trl.estimator.specs import BufferSpec, EstimatorSpec, GranularitySpec, HeadSpec, SettingError
from poise_trl.features.columns import SCALARS, column
from poise_trl.features.features import FeatureLayout, feature_spans
from poise_trl.heads.heads import HEADS
from poise_trl.sampling import RULES, Draw, rule_from_config
from poise_trl.tiny import build_tiny_tokenizer

from .test_config import _config

TABLES = {
    "heads": (HEADS, choices.HEADS),
    "granularities": (GRANULARITIES, choices.GRANULARITIES),
    "rules": (RULES, choices.RULES),
    "bootstraps": (BOOTSTRAPS, choices.BOOTSTRAPS),
    "reward scalings": (REWARD_SCALINGS, choices.REWARD_SCALINGS),
    "schedules": (SCHEDULES, choices.SCHEDULES),
    "routings": (ROUTINGS, choices.ROUTINGS),
}
CONFIG_FIELDS = {  # the POISEConfig field that takes each table's names
    "heads": "probe_head",
    "granularities": "probe_granularity",
    "rules": "prompt_selection",
    "bootstraps": "probe_bootstrap",
    "reward scalings": "scale_rewards",
    "schedules": "probe_schedule",
    "routings": "probe_domain_routing",
}


def _serves(granularity: str, head: str) -> bool:
    """Whether the head has every method the granularity asks of its head."""
    return all(callable(getattr(HEADS[head], method, None)) for method in GRANULARITIES[granularity].head_methods)


ENTRIES = [(table, name) for table, (entries, _) in TABLES.items() for name in entries]
G = 2


@pytest.mark.parametrize("table", TABLES)
def test_each_table_holds_the_names_the_command_lines_offer_and_says_what_each_does(table):
    entries, offered = TABLES[table]
    assert list(entries) == list(offered)
    assert all(text.strip() and not text.endswith(".") for text in offered.values())  # `choices.described` adds it


@pytest.mark.parametrize(("table", "name"), ENTRIES, ids=[f"{t}:{n}" for t, n in ENTRIES])
def test_the_config_takes_every_entry_and_its_help_names_it(table, name):
    settings = {}
    if table == "granularities":  # with a head able to serve it
        settings["probe_head"] = next(head for head in HEADS if _serves(name, head))
    config = _config(**{CONFIG_FIELDS[table]: name, **settings})
    assert getattr(config, CONFIG_FIELDS[table]) == name
    field = {f.name: f for f in dataclasses.fields(config)}[CONFIG_FIELDS[table]]
    assert repr(name) in field.metadata["help"]


def _batch(step: int, n: int = 16, width: int = 4) -> tuple[torch.Tensor, Rollouts]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, width, generator=g)
    rewards = (torch.rand(n, generator=g) < torch.sigmoid(2 * x[:, 0])).float()
    rewards[3] = float("nan")  # an unscorable row
    return x, Rollouts(rewards, prompt_ids=torch.arange(n) // G + 100 * step)


def _run(spec: EstimatorSpec, tmp_path, steps: int = 4, domains: list[str] | None = None) -> POISEEstimator:
    """An estimator of `spec` learns over `steps` batches (its rows named `domains`), gives finite advantages (0 where
    unscorable), and resumes from its file bit for bit."""
    estimator = POISEEstimator(G, spec)

    def batch(step: int) -> tuple[torch.Tensor, Rollouts]:
        x, rollouts = _batch(step)
        return x, Rollouts(rollouts.rewards, domains=domains, prompt_ids=rollouts.prompt_ids)

    for step in range(steps):
        result = estimator.advantages(*batch(step))
        assert result.advantages.isfinite().all() and result.advantages[3] == 0
        estimator.observe(result)
    estimator.save(tmp_path / "e.safetensors")
    resumed = POISEEstimator(G, spec)
    resumed.load(tmp_path / "e.safetensors")
    assert torch.equal(resumed.advantages(*batch(steps)).advantages, estimator.advantages(*batch(steps)).advantages)
    return estimator


@pytest.mark.parametrize("name", list(BOOTSTRAPS))
def test_every_bootstrap_fits_a_finite_line_and_serves_an_estimator_that_resumes_exactly(name, tmp_path):
    fit = BOOTSTRAPS[name]
    if fit is not None:  # None: the partners' mean itself, nothing learned
        g = torch.Generator().manual_seed(0)
        one_group = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # m_i falls as r_i rises: OLS w = -7
        for partners, rewards in (
            (torch.rand(64, generator=g), (torch.rand(64, generator=g) < 0.5).float()),
            (leave_one_out_targets(one_group, 8), one_group),
        ):
            line = fit(partners, rewards)
            assert line.shape == (2,) and line.dtype == torch.float64 and line.isfinite().all()
            # the baseline a + w * m stays within the rewards seen: between their range and m, for any m
            for m in (-1.0, 0.0, 0.5, 1.0, 2.0):
                assert min(0.0, m) <= line[0] + line[1] * m <= max(1.0, m)
    _run(EstimatorSpec(bootstrap=name, buffer=BufferSpec(warmup_steps=100)), tmp_path)  # the bootstrap serves


@pytest.mark.parametrize("name", list(REWARD_SCALINGS))
def test_every_reward_scaling_divides_by_none_or_a_positive_constant_of_earlier_steps(name, tmp_path):
    running = RunningStd()
    for step in range(3):
        divisor = REWARD_SCALINGS[name](running)
        assert divisor is None or (divisor.ndim == 0 and divisor.isfinite() and divisor > 0)
        running.update(torch.rand(8, generator=torch.Generator().manual_seed(step)))
    _run(EstimatorSpec(scale_rewards=name, head=HeadSpec(alpha=1.0), buffer=BufferSpec(warmup_steps=1)), tmp_path)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_trusts_a_fitted_probe_after_the_bootstrap_and_resumes_exactly(name, tmp_path):
    """Two domains learn under the schedule: during the bootstrap every row gets the bootstrap baseline; after it
    each domain's probe is fitted and trusted, and the estimator resumes from its file bit for bit."""
    spec = EstimatorSpec(head=HeadSpec(alpha=1.0), buffer=BufferSpec(size=64, warmup_steps=2, schedule=name))
    domains = [["math", "code"][(i // G) % 2] for i in range(16)]
    estimator = POISEEstimator(G, spec)
    for step in range(2):
        x, rollouts = _batch(step)
        result = estimator.advantages(x, Rollouts(rollouts.rewards, domains=domains))
        assert result.metrics()["bootstrap"] == 1 and not estimator.trusted_
        estimator.observe(result)
    assert all(online.trusted for online in estimator.probes_.values()) and set(estimator.probes_) == {"math", "code"}
    _run(spec, tmp_path, steps=3, domains=domains)


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_every_routing_names_a_domain_from_the_name_alone_and_serves_an_estimator(name, tmp_path):
    sources = ["math__aime", "codegen__taco", " Stem_Web ", "openai/gsm8k", "7"]
    routed = [ROUTINGS[name](source) for source in sources]
    assert all(isinstance(domain, str) and domain for domain in routed)
    assert routed == [ROUTINGS[name](source) for source in reversed(sources)][::-1]  # the name alone decides
    domains = [sources[(i // G) % len(sources)] for i in range(16)]
    spec = EstimatorSpec(head=HeadSpec(alpha=1.0), buffer=BufferSpec(warmup_steps=1, routing=name))
    estimator = _run(spec, tmp_path, domains=domains)
    assert set(estimator.probes_) == set(routed)


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("granularity", list(GRANULARITIES))
def test_every_granularity_takes_the_heads_that_have_its_methods_and_names_the_others(granularity, head):
    able = _serves(granularity, head)
    build = lambda: EstimatorSpec(head=HeadSpec(head), granularity=GranularitySpec(granularity))  # noqa: E731
    if able:
        assert build().granularity.name == granularity
    else:
        with pytest.raises(SettingError, match=f"HeadSpec.name={head!r} with GranularitySpec.name={granularity!r}"):
            build()


@pytest.mark.parametrize("name", list(RULES))
def test_every_rule_is_set_by_config_fields_and_draws_valid_seeded_prompts(name):
    rule_type = RULES[name]
    assert dataclasses.is_dataclass(rule_type) and rule_type.__dataclass_params__.frozen
    config = _config(prompt_selection=name)
    for field in dataclasses.fields(rule_type):
        assert hasattr(config, field.metadata["config"]), field.name  # each setting is a POISEConfig field's
    rule = rule_from_config(config)
    rule.check_objective(config)  # the default loss settings are the objective's
    values = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0, 0.3])
    draws = [rule(values, (torch.tensor(0.0), torch.tensor(1.0)), 3, torch.Generator().manual_seed(7)) for _ in "ab"]
    draw = draws[0]
    assert isinstance(draw, Draw) and draw == draws[1]  # a pure function of the generator's seed
    assert len(draw.indices) == 3 and all(0 <= i < 6 for i in draw.indices)
    assert draw.weights is None or (len(draw.weights) == 3 and min(draw.weights) > 0)
    assert draw.scores is None or len(draw.scores) == 6
    unknown = SimpleNamespace(prompt_selection="nope")
    with pytest.raises(ValueError, match=re.escape(f"choose one of {sorted(RULES)}")):
        rule_from_config(unknown)


def _spans(seed: int = 0) -> tuple[torch.Tensor, object]:
    """A batch of 6 completions of up to 9 tokens, one empty, markers [7, 8] in some, tool tokens in one; with the
    tokenizer the scalars that read the decoded text need."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 10, (6, 9), generator=g)
    ids[1, 3:5] = torch.tensor([7, 8])
    lengths = torch.tensor([9, 6, 0, 4, 1, 7])
    mask = (torch.arange(9) < lengths[:, None]).long()
    generated = torch.ones_like(mask)
    generated[5, 2] = 0
    spans = feature_spans(torch.ones(6, 3), ids, mask, 3, [7, 8], generated, build_tiny_tokenizer())
    return torch.rand(6, 9, generator=g) * 4, spans


@pytest.mark.parametrize("name", list(SCALARS))
def test_every_rollout_scalar_is_one_finite_column_per_row_read_by_the_probe(name):
    entropies, spans = _spans()
    entropies[0, 1] = float("nan")
    values = column(name, entropies, spans)
    assert values.shape == (6,) and values.dtype == torch.float32 and values.isfinite().all()
    order = torch.tensor([5, 2, 0, 4, 1, 3])  # a row's value is its own: rows permuted, values permuted
    assert torch.equal(column(name, entropies[order], spans.rows(order)), values[order])
    assert SCALARS[name].help.strip()
    assert _config(probe_scalars=[name]).probe_scalars == [name]
    layout = FeatureLayout(("prompt", "entropy"), (name,))
    assert torch.equal(layout.assemble(torch.zeros(6, 2, 5), entropies, spans)[:, -1], values)
