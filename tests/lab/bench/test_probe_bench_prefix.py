"""`probe-bench --prefix`: the per-prefix probe's variance explained by position along the completion, its per-token
values against an unpadded recomputation, and the rho arithmetic against its definition."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from poise_lab.bench.value.collect import Collection
from poise_lab.bench.value.prefix import (
    _rho,
    _squared_errors,
    fit_prefix,
    fit_prefix_probe,
    prefix_passes,
    prefix_probe_settings,
    rollout_token_values,
    sampled_rows,
)
from poise_trl.features.features import find_decoder_layers
from poise_trl.features.prefix import PrefixMap
from poise_trl.tiny import build_tiny_model, build_tiny_tokenizer
from tests.test_prefix import N_POOL, D, _batch, _example, _fitted_map, _pass, _rows

from .test_probe_bench import _run


@pytest.fixture(scope="module")
def tiny():
    model = build_tiny_model(build_tiny_tokenizer(), num_layers=2, hidden_size=D, seed=0).eval()
    return model, find_decoder_layers(model)[0]


def test_one_unpadded_rollout_gets_the_values_the_hook_gives_in_a_padded_batch(tiny):
    """`rollout_token_values` (the instrument's entry point for one unpadded rollout) gives the values the trainer's
    hook gives the same rollout in a padded batch."""
    model, layer = tiny
    prompts, completions = _example()
    ids = _batch(model, prompts, completions)
    prefix_map, _ = _fitted_map(model, layer, ids)
    _, values, _, entropies = _pass(model, layer, ids, prefix_map)
    row = 1
    unpadded = torch.cat([torch.tensor(prompts[row]), torch.tensor(completions[row])])
    with torch.no_grad():
        states = model(unpadded[None], output_hidden_states=True).hidden_states[1][0]
    entropy = entropies[row, : len(completions[row])]
    single = rollout_token_values(states, len(prompts[row]), entropy, prefix_map, N_POOL)
    assert torch.allclose(single, values[row, : len(completions[row])], atol=1e-4)


def test_rollout_token_values_refuses_entropies_of_another_length():
    x, y = _rows(20)
    with pytest.raises(ValueError, match="entropies for 3 completion tokens"):
        rollout_token_values(torch.zeros(5, 8), 2, torch.zeros(4), PrefixMap.fold(fit_prefix_probe(x, y), 8), 2)


def test_squared_errors_split_each_rollout_into_relative_position_bins():
    rewards = torch.tensor([1.0, 0.0])
    values = torch.tensor([[0.0, 0.5, 1.0, 1.0, 9.0], [0.5, 0.0, 9.0, 9.0, 9.0]])
    generated = torch.tensor([[True, True, True, True, False], [True, True, False, False, False]])
    error, present = _squared_errors(rewards, values, generated, bins=2)
    # row 0: 4 tokens, halves (0, 1) and (2, 3); row 1: 2 tokens, one per half; padding never counts
    torch.testing.assert_close(error, torch.tensor([[(1 + 0.25) / 4, 1.25 / 2, 0.0], [0.125, 0.25, 0.0]]).double())
    assert present.all()
    _, present = _squared_errors(rewards, values, generated, bins=4)
    assert present[1].tolist() == [True, True, False, True, False]  # 2 tokens: bins 0 and 2 only


def test_rho_is_one_minus_mse_over_reward_variance_and_resamples_by_prompt():
    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 2, (6, 4)).astype(float)
    error = rng.random((6, 4, 2))
    present = np.ones((6, 4, 2), bool)
    present[0, :, 1] = False
    point = _rho(error, present, rewards, np.ones(6))
    assert point[0] == pytest.approx(1 - error[..., 0].mean() / rewards.var())
    assert point[1] == pytest.approx(1 - error[1:, :, 1].mean() / rewards[1:].var())
    counts = np.array([[2, 0, 1, 1, 1, 1]])  # prompt 0 twice, prompt 1 left out
    rows = [0, 0, 2, 3, 4, 5]
    assert _rho(error, present, rewards, counts)[0, 0] == pytest.approx(
        1 - error[rows, :, 0].mean() / rewards[rows].var()
    )
    missing = error.copy()
    missing[0, 0, 0] = np.nan  # a rollout without a value leaves the column
    keep = np.ones((6, 4), bool)
    keep[0, 0] = False
    assert _rho(missing, present, rewards, np.ones(6))[0] == pytest.approx(
        1 - error[..., 0][keep].mean() / rewards[keep].var()
    )
    exact = _rho((rewards[..., None] - rewards[..., None]) ** 2 * np.ones((1, 1, 2)), present, rewards, np.ones(6))
    np.testing.assert_allclose(exact, 1.0)


def test_command_reports_the_per_prefix_probe_beside_the_sequence_level_one(tiny_model_path, tmp_path):
    out = tmp_path / "bench"
    argv = [str(tiny_model_path), "--dataset", "sort", "--num-prompts", "16", "--k", "4", "--max-new-tokens", "6"]
    argv += ["--reward-fn", "tests.lab.bench.test_probe_bench:toy_reward", "--mlps", "", "--bootstrap", "50"]
    argv += ["--device", "cpu", "--seed", "1", "--pool-tokens", "3", "--no-critic", "--splits", "0"]
    argv += ["--feature-batch-size", "5", "--output-dir", str(out), "--prefix"]
    results = _run(argv)
    prefix = results["prefix"]
    names = [row["name"] for row in prefix["table"]]
    assert names == [
        "Per-prefix probe V(x, y_<t)",
        "POISE: the partner's value, G=2",
        "Probe on the rollout's own completion (reference, biased)",
        "Train mean",
        "Per-prefix − POISE: the partner's value, G=2 (paired)",
    ]
    collection = Collection.load(out / "collection.safetensors")
    assert prefix["settings"] == {**prefix_probe_settings(collection.meta), "bins": 4, "layer": 2}
    assert prefix["held_out_rollouts"] == 16 and prefix["train_rollouts"] == 48
    assert prefix["train_rows"] == 48 * prefix["settings"]["samples"]
    for row in prefix["table"]:
        for cell in [row["all"], *row["bins"]]:
            assert cell["value"] <= 1 and cell["ci"][0] <= cell["value"] <= cell["ci"][1]
    rows = {row["name"]: row for row in prefix["table"]}
    difference = rows["Per-prefix probe V(x, y_<t)"]["all"]["value"] - rows[names[1]]["all"]["value"]
    assert prefix["table"][-1]["all"]["value"] == pytest.approx(difference)
    report = (out / "results.md").read_text()
    assert "## Per-prefix value" in report and "| Per-prefix probe V(x, y_<t) |" in report


def test_batched_token_values_match_an_unpadded_pass_per_rollout(tiny_model_path, tmp_path):
    """The hook's values on a padded batch (prompts of several widths, completions of several lengths) equal
    `rollout_token_values` on each rollout's own unpadded hidden states: no state after token t-1, no padding."""
    out = tmp_path / "bench"
    argv = [str(tiny_model_path), "--dataset", "sort", "--num-prompts", "8", "--k", "2", "--max-new-tokens", "6"]
    argv += ["--reward-fn", "tests.lab.bench.test_probe_bench:toy_reward", "--mlps", "", "--bootstrap", "10"]
    argv += ["--device", "cpu", "--pool-tokens", "3", "--no-critic", "--splits", "0", "--output-dir", str(out)]
    _run(argv)
    collection = Collection.load(out / "collection.safetensors")
    model = AutoModelForCausalLM.from_pretrained(collection.meta["model_path"]).eval()
    settings = prefix_probe_settings(collection.meta)
    rollouts = torch.arange(collection.rewards.numel())
    rows, targets = sampled_rows(model, collection, rollouts, settings)
    targets = targets + torch.linspace(0, 1, targets.numel())  # a probe with non-zero weights, whatever the rewards
    prefix_map = fit_prefix(rows, targets, settings, int(collection.meta["hidden_size"]))
    layer = int(collection.meta["default_layer"])
    for chunk, spans, _, values in prefix_passes(model, collection, rollouts, settings, prefix_map, batch_size=5):
        for row, i in enumerate(chunk.tolist()):
            p = int(collection.prompt_index[i])
            prompt = collection.prompt_ids[p][collection.prompt_mask[p].bool()]
            completion = collection.completion_ids[i][collection.completion_mask[i].bool()].long()
            with torch.no_grad():
                output = model(input_ids=torch.cat([prompt, completion])[None], output_hidden_states=True)
            logits = output.logits[0, prompt.numel() - 1 : -1] / float(collection.meta["temperature"])
            entropies = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
            hidden = output.hidden_states[layer + 1][0]
            expected = rollout_token_values(hidden, prompt.numel(), entropies, prefix_map, settings["pool_tokens"])
            n = completion.numel()
            assert spans.generated[row].sum() == n
            torch.testing.assert_close(values[row, :n], expected, rtol=1e-4, atol=1e-4)
