"""The glossary's metrics as a real tracker receives them: a run with `report_to="tensorboard"` (offline) is read
back from its event files with TensorBoard's own `EventAccumulator`.

Every `poise/*` key docs/metrics.md lists must arrive, and an undefined value must be handled as the glossary says:
left out of that log line (never `None`, which transformers' TensorBoard callback drops with a warning and which
other trackers record as a null)."""

import math
import re

import pytest
from datasets import Dataset
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from poise_trl import POISETrainer

from ..conftest import digit_reward, short_args
from ..docs.test_docs import GLOSSARY, METRIC

DOMAINS, LAYERS = ("a", "b"), (1, 2)
PER_DOMAIN = ("bootstrap", "buffer_size")  # beside the first table's keys (the glossary's "Per domain" section)


def glossary_keys() -> set[str]:
    """The glossary's keys with their placeholders filled in for this run's domains and candidate layers."""
    first_table = GLOSSARY.split("## Value estimation", 1)[1].split("\n## ", 1)[0]
    per_domain = [key.removeprefix("poise/") for key in METRIC.findall(first_table)] + list(PER_DOMAIN)
    keys = set()
    for key in METRIC.findall(GLOSSARY):
        if key == "poise/domain/<name>/<key>":
            keys |= {f"poise/domain/{domain}/{name}" for domain in DOMAINS for name in per_domain}
        elif key == "poise/layer_mae/<ℓ>":
            keys |= {f"poise/layer_mae/{layer}" for layer in LAYERS}
        elif key.startswith("poise/prefix/"):  # probe_granularity="prefix" only, which refuses probe_layer="auto":
            continue  # tests/test_prefix_trainer.py checks they are logged, through the same `_metrics` as these
        elif not re.match(r"poise/domain/(?!<)", key):  # `poise/domain/math/...` is the glossary's example
            keys.add(key)
    return keys


@pytest.mark.slow
def test_every_glossary_key_arrives_in_tensorboard_and_undefined_values_are_left_out(tiny_model_path, tmp_path):
    rows = [{"prompt": f"{i % 10}{(3 * i) % 10}+{i % 7}", "domain": "ab"[i % 2]} for i in range(32)]
    dataset = Dataset.from_list(rows)
    args = short_args(
        tmp_path,
        max_steps=4,
        report_to="tensorboard",
        probe_layer="auto",
        probe_layer_candidates=list(LAYERS),
        probe_layer_select_every=1,
        probe_layer_folds=2,
        probe_domain_column="domain",
        prompt_selection="value",
    )
    trainer = POISETrainer(model=str(tiny_model_path), reward_funcs=digit_reward, args=args, train_dataset=dataset)
    trainer.train()

    (run_dir,) = (tmp_path / "out" / "runs").iterdir()  # transformers' default logging folder
    events = EventAccumulator(str(run_dir))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    expected = glossary_keys()
    assert len(expected) > 50
    missing = sorted(key for key in expected if f"train/{key}" not in scalars)
    assert not missing, f"glossary keys TensorBoard never received: {missing}"
    assert "train/frac_reward_zero_std" in scalars  # TRL's own metrics arrive beside them

    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(steps) == 4
    undefined_somewhere = False
    for key in sorted(expected):
        logged = {entry["step"]: entry[key] for entry in steps if key in entry}
        assert all(isinstance(v, int | float) and math.isfinite(v) for v in logged.values()), (key, logged)
        received = {event.step: event.value for event in events.Scalars(f"train/{key}")}
        assert received.keys() == logged.keys(), key  # a step where the key was undefined is absent in both
        assert received == pytest.approx(logged, rel=1e-6), key
        undefined_somewhere |= len(logged) < len(steps)
    # The run does hit undefined values (e.g. the probe's predictions before it is trusted), so the check above is
    # not vacuous.
    assert undefined_somewhere
    assert "poise/value_mean" not in steps[0] and "poise/value_mean" in steps[-1]
