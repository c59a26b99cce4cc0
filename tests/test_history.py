"""history.py with plain tensors (counts, decayed means, the cap and its eviction, keys every process computes alike,
the state), and the estimator with a `HistorySpec`: a step's rewards never reach its own baselines but do reach the
next step's, the sampler's prompt values read only earlier steps, and a resume from the file is exact."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from poise_trl.estimator.buffer import prompt_group_ids
from poise_trl.estimator.estimator import POISEEstimator, Rollouts
from poise_trl.estimator.history import PromptHistory, segmented_sums
from poise_trl.estimator.specs import EstimatorSpec, GranularitySpec, HistorySpec, PromptSpec

from .host_sync import HostSyncCounter
from .test_estimator import spec

G = 2
NAN = float("nan")


def _reference(steps: list[tuple[list[int], list[float]]], decay: float) -> dict[int, tuple[int, float]]:
    """prompt -> (count, mean) by the definition: rewards k steps back weigh decay**k; NaN rewards are skipped."""
    rewards: dict[int, list[tuple[int, float]]] = {}
    for step, (keys, values) in enumerate(steps):
        for key, value in zip(keys, values, strict=True):
            if value == value:
                rewards.setdefault(key, []).append((step, value))
    last = len(steps) - 1
    return {
        key: (len(seen), sum(decay ** (last - s) * v for s, v in seen) / sum(decay ** (last - s) for s, _ in seen))
        for key, seen in rewards.items()
    }


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_counts_and_means_after_several_updates(decay):
    """Several rows of a prompt per step, in any order, NaN rewards skipped, a prompt absent for a few steps."""
    steps = [
        ([7, 3, 7, 3], [1.0, 0.0, 0.0, 0.0]),
        ([3, 3, -5, -5], [1.0, NAN, 0.5, 0.25]),
        ([9, 9], [NAN, NAN]),  # never scored: never seen
        ([7, 7, 7, 7, -5, -5], [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]),
    ]
    history = PromptHistory(size=8, decay=decay)
    for keys, rewards in steps:
        history.update(torch.tensor(keys), torch.tensor(rewards))
    seen, count, mean = history.lookup(torch.tensor([7, 3, -5, 9, 11]))
    expected = _reference(steps, decay)
    assert seen.tolist() == [True, True, True, False, False]
    assert count.tolist() == [expected[7][0], expected[3][0], expected[-5][0], 0, 0] == [6, 3, 4, 0, 0]
    assert mean.tolist() == pytest.approx([expected[7][1], expected[3][1], expected[-5][1], 0.0, 0.0], abs=1e-12)
    columns = history.columns(torch.tensor([3, 11])).flatten().tolist()
    assert columns == pytest.approx([1.0, torch.log1p(torch.tensor(3.0)).item(), expected[3][1], 0, 0, 0])
    assert history.steps == 4


def test_segmented_sums_add_within_each_key_only():
    keys = torch.tensor([1, 1, 1, 4, 6, 6, 6, 6, 6])
    sums = segmented_sums(keys, torch.arange(1.0, 10.0))
    assert sums.tolist() == [1, 3, 6, 4, 5, 11, 18, 26, 35]


def test_the_cap_evicts_the_least_recently_seen_prompt_first():
    """Three slots: a fourth prompt takes the slot of the prompt seen longest ago; of several new prompts in one full
    step, the smaller keys stay (ties among the most recent break by key, the same everywhere)."""
    history = PromptHistory(size=3)
    for keys in ([1], [2], [3], [1], [4]):  # 2 was last seen longest ago when 4 arrives
        history.update(torch.tensor(keys), torch.tensor([1.0] * len(keys)))
    assert history.lookup(torch.tensor([1, 2, 3, 4]))[0].tolist() == [True, False, True, True]
    assert history.lookup(torch.tensor([1]))[1].tolist() == [2]  # a kept prompt keeps its count
    history.update(torch.tensor([50, 40, 30, 20]), torch.ones(4))
    assert history.lookup(torch.tensor([1, 3, 4, 20, 30, 40, 50]))[0].tolist() == [False] * 3 + [True] * 3 + [False]
    history.update(torch.tensor([2]), torch.zeros(1))  # an evicted prompt comes back with a fresh count
    assert history.lookup(torch.tensor([2]))[1].tolist() == [1]


def test_a_lookup_and_an_update_never_wait_for_the_device():
    history = PromptHistory(size=16, decay=0.9)
    counter = HostSyncCounter()
    with counter:
        for step in range(4):
            keys = torch.arange(12) // 2 + step
            history.columns(keys)
            history.update(keys, torch.rand(12))
    assert counter.count == 0, counter.calls


def test_the_state_round_trips_exactly_and_a_smaller_table_keeps_the_newest(tmp_path):
    history = PromptHistory(size=10, decay=0.8)
    for step in range(6):
        history.update(torch.tensor([step, step + 1, step + 1]), torch.tensor([0.25, 1.0, 0.0]))
    state, info = history.state_dict(), history.info()
    assert state["keys"].tolist() == list(range(7)) and info == {"size": 10, "decay": 0.8, "steps": 6}
    loaded = PromptHistory(size=10, decay=0.8)
    loaded.load_state_dict(state, info)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in state.items()) and loaded.steps == 6
    keys, rewards = torch.tensor([3, 6, 8]), torch.tensor([1.0, 0.5, 0.0])
    history.update(keys, rewards)
    loaded.update(keys, rewards)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in history.state_dict().items())
    small = PromptHistory(size=2, decay=0.8)
    small.load_state_dict(state, info)
    assert small.state_dict()["keys"].tolist() == [5, 6]  # the two seen at the last step


def test_prompt_ids_are_the_same_in_another_process():
    """The history is keyed by `prompt_group_ids` (blake2b), not Python's `hash()`, which is salted per process."""
    prompts = ["12+3", [{"role": "user", "content": "Solve 2+2."}], {"text": "x", "id": 3}]
    code = (
        "import json, sys; from poise_trl.estimator.buffer import prompt_group_ids; "
        "print(json.dumps(prompt_group_ids(json.loads(sys.argv[1])).tolist()))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(prompts)], capture_output=True, text=True, env=env)
    assert json.loads(out.stdout) == prompt_group_ids(prompts).tolist(), out.stderr


# ------------------------------------------------------------------------------------------------------ estimator
def _batch(step: int, n: int = 16, width: int = 6):
    """Features whose first column predicts the reward, binary rewards, and prompt ids drawn from 6 prompts, so
    prompts repeat across steps (a prompt's G rows share its id)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, width, generator=g)
    r = (torch.rand(n, generator=g) < torch.sigmoid(2 * x[:, 0])).float()
    ids = torch.randint(6, (n // G,), generator=g).repeat_interleave(G) * 1000 + 17
    return x, r, ids


HISTORY = spec(history=HistorySpec())


def _estimator(steps: int = 4, settings: EstimatorSpec = HISTORY) -> POISEEstimator:
    estimator = POISEEstimator(G, settings)
    for step in range(steps):
        x, r, ids = _batch(step)
        estimator.observe(estimator.advantages(x, Rollouts(r, prompt_ids=ids)))
    return estimator


@pytest.mark.parametrize("partner_reward", [False, True])
def test_a_steps_rewards_never_reach_its_own_baselines_but_reach_the_next_steps(partner_reward):
    """Score one batch from the same state with its rewards perturbed: every baseline of the step stays bit for bit
    (without the partner's reward as input; with it, each rollout's own), while the history the next step reads,
    and so its baselines, move."""
    estimator = _estimator(settings=spec(HISTORY, partner_reward=partner_reward))
    x, r, ids = _batch(10)
    flipped = torch.where(torch.arange(r.numel()) % 2 == 0, 1 - r, r)  # the first rollout of every prompt
    follow = _batch(11)
    states, baselines, nexts, columns = [], [], [], []
    for rewards in (r, flipped):
        state = copy.deepcopy(estimator)
        result = state.advantages(x, Rollouts(rewards, prompt_ids=ids))
        baselines.append(result.baselines)
        state.observe(result)
        columns.append(state.history_columns(follow[2], follow[2].numel()))
        nexts.append(state.advantages(follow[0], Rollouts(follow[1], prompt_ids=follow[2])).baselines)
        states.append(state)
    assert torch.isfinite(baselines[0]).all() and baselines[0].abs().sum() > 0
    if partner_reward:  # the flipped rollouts' own baselines (their partners' inputs hold only the partners' rewards)
        assert torch.equal(baselines[0][0::2], baselines[1][0::2])
    else:
        assert torch.equal(baselines[0], baselines[1])
    assert not torch.equal(columns[0][:, 2], columns[1][:, 2])  # the next step's mean-reward column moved
    assert not torch.equal(nexts[0], nexts[1])


def test_without_prompt_ids_the_history_refuses_and_a_step_reads_only_earlier_ones():
    estimator = _estimator(steps=0)
    x, r, ids = _batch(0)
    with pytest.raises(ValueError, match=r"history=True \(probe_history\) .* give prompt_ids"):
        estimator.advantages(x, Rollouts(r))
    result = estimator.advantages(x, Rollouts(r, prompt_ids=ids))
    assert (result.batch.features[:, 0, -3:] == 0).all()  # nothing seen before the first step
    estimator.observe(result)
    seen, count, _ = estimator.prompt_history_.lookup(ids)
    assert seen.all() and count.min() >= G and estimator.probes_["default"].buffer.features.size(-1) == 6 + 1 + 3


def test_the_samplers_prompt_values_read_the_history_before_the_step():
    """The prompt-only value of a candidate moves with its history alone (the same prompt states), and only
    `observe` changes that history."""
    estimator = _estimator(steps=6, settings=spec(HISTORY, prompt=PromptSpec((0, 3))))
    states, ids = torch.zeros(2, 3), torch.tensor([17, 123456789])  # one seen prompt, one never seen
    before = estimator.prompt_values(states, ids)
    assert before.shape == (2,) and before[0] != before[1]
    assert torch.equal(estimator.prompt_values(states, ids), before)  # reading changes nothing
    x, r, batch_ids = _batch(20)
    estimator.advantages(x, Rollouts(r, prompt_ids=batch_ids))
    assert torch.equal(estimator.prompt_values(states, ids), before)  # nor does taking a step's advantages


def test_a_resume_from_the_file_is_exact_and_files_without_history_still_load(tmp_path):
    """Save after 3 steps, load into a fresh estimator, run 3 more on both: identical states, bit for bit. A file
    without history loads into an estimator without it; across the setting, a clear error."""
    settings = spec(prompt=PromptSpec((0, 3)), history=HistorySpec(decay=0.9, size=5))
    first = _estimator(steps=3, settings=settings)
    first.save(tmp_path / "e.safetensors")
    resumed = POISEEstimator(G, settings)
    resumed.load(tmp_path / "e.safetensors")
    for step in range(3, 6):
        x, r, ids = _batch(step)
        for estimator in (first, resumed):
            estimator.observe(estimator.advantages(x, Rollouts(r, prompt_ids=ids)))
    a, b = first.state_dict(), resumed.state_dict()
    assert a["info"] == b["info"] and a["tensors"].keys() == b["tensors"].keys()
    assert all(torch.equal(v, b["tensors"][k]) for k, v in a["tensors"].items())
    assert a["info"]["history"] == {"size": 5, "decay": 0.9, "steps": 6} and "history.keys" in a["tensors"]
    plain = POISEEstimator(G, spec())
    x, r, _ = _batch(0)
    plain.observe(features=x, rollouts=Rollouts(r))
    plain.save(tmp_path / "plain.safetensors")
    POISEEstimator(G, spec()).load(tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match=r"probe_history=False, but this run sets probe_history=True"):
        POISEEstimator(G, spec(history=HistorySpec())).load(tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match=r"probe_history=True, but this run sets probe_history=False"):
        POISEEstimator(G).load(tmp_path / "e.safetensors", warm_start=True)
    with pytest.raises(ValueError, match=r"probe_history_size=5, probe_history_decay=0.9, but this run sets 8"):
        POISEEstimator(G, spec(history=HistorySpec(size=8, decay=0.9))).load(tmp_path / "e.safetensors")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: HistorySpec(size=0), r"HistorySpec.size=0 must be an int >= 1"),
        (lambda: HistorySpec(decay=0.0), r"HistorySpec.decay=0.0 must be in \(0, 1\]"),
        (
            lambda: EstimatorSpec(history=HistorySpec(), granularity=GranularitySpec("prefix")),
            r"EstimatorSpec.history=True with GranularitySpec.name='prefix': the per-prefix value",
        ),
    ],
)
def test_bad_history_settings_are_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_updated_returns_a_new_table_and_leaves_this_one_as_it_was():
    history = PromptHistory(size=4)
    history.update(torch.tensor([1, 2]), torch.tensor([1.0, 0.0]))
    before = history.state_dict()
    new = history.updated(torch.tensor([1, 3]), torch.tensor([0.0, 1.0]))
    assert history.steps == 1 and all(torch.equal(v, history.state_dict()[k]) for k, v in before.items())
    assert new.steps == 2 and new.lookup(torch.tensor([1, 3]))[1].tolist() == [2, 1]
