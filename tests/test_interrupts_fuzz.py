"""A stop at any line of `poise_trl` leaves the estimator before or after the call, and no hook behind (issue 57).

The line-level interrupt fuzz (tests/interrupts.py): a KeyboardInterrupt at the Nth executed line of a `poise_trl`
source file, once for the first run of every distinct line the call runs, during `observe`, `advantages`,
`prompt_values` and `load_state_dict` (resume and warm start) of estimators that between them run every head, the
history, the layer choice, domains, both bootstraps, the batch scaling, the per-prefix baseline and the reference
preset's estimator (its global schedule, whose end falls in the stopped `observe`, whole-pair buffers, routing and
refusals), and during a captured pass of a tiny model. After each stop the estimator's `state_dict()` equals the one
before the call or the one after an uninterrupted call (tensors bit for bit), it still takes the next step's
advantages, and no forward hook is left on any module. The trainer's scenario
(tests/scenarios/test_interrupts_trainer.py) stops `train()` and `evaluate()` the same way.
"""

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
import torch

from poise_trl.estimator.estimator import POISEEstimator, Rollouts
from poise_trl.estimator.specs import (
    BufferSpec,
    EstimatorSpec,
    GranularitySpec,
    HeadSpec,
    HistorySpec,
    LayerSpec,
    PromptSpec,
)
from poise_trl.features.capture import capture_pass
from poise_trl.features.features import FeatureLayout, feature_spans, find_decoder_layers
from poise_trl.features.prefix import PrefixBatch, PrefixCapture, feature_width, prefix_spans
from poise_trl.tiny import build_tiny_model, build_tiny_tokenizer

from .interrupts import Stop, first_lines, forward_hooks, lines_run, same_state, stop_at, where

G, ROWS, WIDTH, HIDDEN = 2, 16, 6, 4  # HIDDEN: the prefix rows' hidden size
BUFFER = BufferSpec(size=64, warmup_steps=1)
SETTINGS = {  # between them, every head and option the estimator learns with; the cheapest first
    "prefix": EstimatorSpec(
        buffer=BUFFER,
        granularity=GranularitySpec("prefix"),
        partner_reward=False,
        bootstrap="rloo",
    ),
    "mlp": EstimatorSpec(head=HeadSpec(name="mlp", kwargs={"hidden": 3, "iterations": 2}), buffer=BUFFER),
    "logistic": EstimatorSpec(head=HeadSpec(name="logistic", alpha=1.0), buffer=BUFFER),
    "ensemble": EstimatorSpec(
        head=HeadSpec(name="ensemble", kwargs={"children": ["ridge", "logistic"], "combine": "stack", "folds": 2}),
        buffer=BUFFER,
    ),
    "reference": EstimatorSpec(  # probe_preset="reference"'s, on two routed domains; the bootstrap ends at step 4
        head=HeadSpec(name="pca_ridge", alpha=100.0, pca_dims=((0, 4, 2),), clip=(0.0, 1.0)),
        buffer=BufferSpec(
            size=64,
            domain_sizes={"math": 64, "code": 16},
            warmup_steps=4,
            schedule="global",
            whole_groups=True,
            routing="reference",
            same_domain_groups=True,
        ),
        partner_reward=False,
        bootstrap="rloo",
        reward_range=(0.0, 1.0),
    ),
    "ridge": EstimatorSpec(
        head=HeadSpec(alpha=1.0, pca_dims=((0, 4, 2),)),
        history=HistorySpec(size=32),
        layers=LayerSpec(ids=(3, 5), select_every=1, folds=2),  # two candidate layers, re-chosen every step
        buffer=BufferSpec(size=64, domain_sizes={"code": 8}, warmup_steps=1),
        scale_rewards="batch",
        prompt=PromptSpec(columns=(0, 3)),
    ),
}


@dataclass
class Batch:
    features: torch.Tensor
    rollouts: Rollouts
    prefix: PrefixBatch | None = None
    prompts: torch.Tensor = field(default_factory=lambda: torch.zeros(0))


def _batch(name: str, step: int) -> Batch:
    """Step `step`'s batch for the estimator of `SETTINGS[name]`: features whose first column predicts the reward,
    (N, 2, D) for the two candidate layers, two domains and prompt ids for "ridge", a token capture for "prefix"."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(ROWS, 2 if name == "ridge" else 1, WIDTH, generator=g)
    rewards = (torch.rand(ROWS, generator=g) < torch.sigmoid(2 * x[:, 0, 0])).float()
    ids = torch.arange(ROWS) // G + 100 * (step % 3)  # prompts seen again: their history grows
    domains = [["math", "code"][(i // G) % 2] for i in range(ROWS)] if name == "ridge" else None
    if name == "reference":  # data sources, routed to math and code
        domains = [["math__aime", "codegen__taco"][(i // G) % 2] for i in range(ROWS)]
    prefix = None
    if name == "prefix":
        prefix = PrefixBatch(
            rows=torch.randn(ROWS, 4, feature_width(HIDDEN), generator=g),
            sampled=torch.ones(ROWS, 4, dtype=torch.bool),
            values=torch.rand(ROWS, 6, generator=g),
            generated=torch.ones(ROWS, 6, dtype=torch.bool),
            tokens=torch.arange(4).expand(ROWS, -1),
        )
    return Batch(x, Rollouts(rewards, domains=domains, prompt_ids=ids), prefix, torch.randn(5, 3, generator=g))


def _trained(name: str, steps: int = 3) -> POISEEstimator:
    estimator = POISEEstimator(G, SETTINGS[name])
    for step in range(steps):
        batch = _batch(name, step)
        estimator.observe(estimator.advantages(batch.features, batch.rollouts, batch.prefix))
    return estimator


def _works(estimator: POISEEstimator, batch: Batch) -> None:
    """The estimator still takes a batch's advantages (a torn head would raise, a torn buffer give NaN)."""
    assert torch.isfinite(estimator.advantages(batch.features, batch.rollouts, batch.prefix).advantages).all()


Call = Callable[[POISEEstimator, Batch], Any]
CALLS: dict[str, Call] = {
    "observe": lambda estimator, batch: estimator.observe(
        estimator.advantages(batch.features, batch.rollouts, batch.prefix)
    ),
    "advantages": lambda estimator, batch: estimator.advantages(batch.features, batch.rollouts, batch.prefix),
    "prompt_values": lambda estimator, batch: estimator.prompt_values(batch.prompts, batch.rollouts.prompt_ids[:5]),
}


def _fuzz(call: Call, name: str, covered: set, estimator: POISEEstimator | None = None) -> int:
    """Stop `call` (given a fresh copy of `_trained(name)` and the next batch) at the first run of every line not in
    `covered` yet; after each stop the state is the one before or after the call and the estimator still works.
    Returns the stops made."""
    estimator = _trained(name) if estimator is None else estimator
    batch, next_batch = _batch(name, 3), _batch(name, 4)
    before, done = estimator.state_dict(), copy.deepcopy(estimator)
    seen = lines_run(partial(call, done, batch))
    after, stops = done.state_dict(), 0
    for line, n in first_lines(seen).items():
        if line in covered:
            continue
        covered.add(line)
        stopped = copy.deepcopy(estimator)
        with pytest.raises(Stop), stop_at(n):
            call(stopped, batch)
        state = stopped.state_dict()
        assert same_state(state, before) or same_state(state, after), f"{name}: torn by a stop at {where(line)}"
        _works(stopped, next_batch)
        stops += 1
    return stops


@pytest.mark.parametrize("call", ["observe", "advantages", "prompt_values"])
def test_a_stop_at_any_line_leaves_the_state_before_or_after(call):
    covered: set = set()
    names = ["ridge"] if call == "prompt_values" else list(SETTINGS)
    assert sum(_fuzz(CALLS[call], name, covered) for name in names) > 20
    if call == "observe":  # the stops reached every part of what the estimator learns with
        files = {where(line).split(":")[0] for line in covered}
        estimator = {"estimator", "state", "learner", "buffer", "history", "baselines", "granularity", "layer_choice"}
        assert {f"estimator/{name}.py" for name in estimator} <= files
        assert {f"heads/{name}.py" for name in ("probe", "logistic", "mlp", "ensemble")} <= files
        assert {"heads/pca_ridge.py", "estimator/schedule.py", "estimator/domains.py"} <= files


def _load(estimator: POISEEstimator, batch: Batch, saved: dict[str, Any], warm_start: bool) -> None:
    estimator.load_state_dict(saved, warm_start=warm_start)


@pytest.mark.parametrize("warm_start", [False, True])
def test_a_stop_inside_load_state_dict_leaves_the_state_before_or_after(warm_start):
    covered: set = set()
    stops = 0
    for name in SETTINGS:
        saved = _trained(name, steps=5).state_dict()
        stops += _fuzz(partial(_load, saved=saved, warm_start=warm_start), name, covered)
    assert stops > 20


def test_a_stop_inside_a_captured_pass_leaves_no_hook():
    """Every line `capture_pass` runs around a forward of a tiny model (every candidate layer and a token capture):
    a stop there leaves no forward hook on any module, and the next pass captures as before."""
    model = build_tiny_model(build_tiny_tokenizer(), num_layers=3, hidden_size=32, seed=0).eval()
    layers = list(find_decoder_layers(model))
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    completion_ids, completion_mask = (
        torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]]),
        torch.tensor([[1, 1, 1, 0], [1] * 4]),
    )
    ids = torch.cat([torch.tensor([[0, 3, 4, 5], [6, 7, 8, 9]]), completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    spans = feature_spans(prompt_mask, completion_ids, completion_mask, 2, None)

    def captured() -> torch.Tensor:
        tokens = PrefixCapture(prefix_spans(prompt_mask, completion_mask, 2, 2, None, torch.Generator()), None)
        with torch.no_grad(), capture_pass(layers, spans, FeatureLayout(), tokens) as capture:
            logits = model(ids, attention_mask=mask).logits[:, -5:-1]
        entropies = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        return capture.result(entropies)[0]

    expected = captured()
    kept = []  # as IPython keeps the last traceback: its frames keep every generator and frame of the pass alive
    for line, n in first_lines(lines_run(captured)).items():
        with pytest.raises(Stop) as stopped, stop_at(n):
            captured()
        kept.append(stopped.value)
        assert not forward_hooks(model), f"a hook left by a stop at {where(line)}"
        assert torch.equal(captured(), expected)
    assert len(kept) > 20
