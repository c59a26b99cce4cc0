"""examples/custom_loop.py, executed: POISE's estimator in a plain PyTorch loop (no TRL trainer) on the sort task."""

import importlib.util
import math
from pathlib import Path

import pytest

from poise_lab.models.toy import prepare_demo_model
from poise_lab.tasks.toy import make_sort_splits

EXAMPLE = Path(__file__).parents[2] / "examples" / "custom_loop.py"
STEPS, PROBE_WARMUP, PROMPTS = 6, 2, 8


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    spec = importlib.util.spec_from_file_location("custom_loop", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    task = dict(num_train=200, min_digits=2, max_digits=4, seed=0)
    # 50 supervised steps: right about a quarter of the time, so rewards vary within and across groups.
    model = prepare_demo_model(tmp_path_factory.mktemp("cache"), warmup_steps=50, **task)
    train_set, eval_set = make_sort_splits(num_eval=12, **task)
    return example.train(
        str(model),
        train_set,
        eval_set,
        steps=STEPS,
        prompts_per_step=PROMPTS,
        probe_warmup_steps=PROBE_WARMUP,
        eval_k=2,
    )


@pytest.mark.slow
def test_custom_loop_takes_finite_advantages_from_the_estimator(run):
    history = run["history"]
    assert len(history) == STEPS and run["estimator"].steps_ == STEPS  # observe ran once per step
    for step in history:
        assert len(step["advantages"]) == 2 * PROMPTS
        assert all(math.isfinite(a) for a in step["advantages"])
    assert any(step["reward"] > 0 for step in history)  # the task gives the loop something to learn from
    assert 0 <= run["avg_at_k_before"] <= 1 and 0 <= run["avg_at_k_after"] <= 1


@pytest.mark.slow
def test_the_probe_becomes_trusted_and_each_rollout_gets_its_partners_prediction(run):
    history = run["history"]
    assert [step["trusted"] for step in history] == [i + 1 >= PROBE_WARMUP for i in range(STEPS)]
    assert history[0]["bootstrap"] == 1.0
    predicted = []
    for step in history[PROBE_WARMUP:]:  # baselines from the probe fitted on earlier steps only
        assert step["bootstrap"] == 0.0
        values, baselines = step["values"], step["baselines"]
        assert all(0.0 <= v <= 1.0 for v in values)  # clipped to the observed reward range
        assert baselines == [values[i ^ 1] for i in range(len(values))]  # G = 2: the partner's value, not its own
        predicted += values
    assert len(set(predicted)) > 1  # the probe tells rollouts apart
