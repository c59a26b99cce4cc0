"""`poise-trl probe-bench` on the tiny model: features against an independent recomputation, leave-one-out targets,
prompt splits without leakage, the critic, and the command end to end (its exported probe warm-starts the trainer)."""

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from poise_lab.bench.cli import add_probe_bench_parser
from poise_lab.bench.critic import load_critic, predict_critic, train_critic
from poise_lab.bench.value.collect import Collection, collect
from poise_lab.bench.value.resolve import load_prompts
from poise_lab.bench.value.score import ValueBenchmark, split_by_prompt
from poise_lab.tasks.arith import make_arith_splits
from poise_trl import POISEConfig, POISETrainer
from poise_trl.estimator.buffer import prompt_group_ids
from poise_trl.estimator.files import read_state

from ...conftest import CPU_ARGS

MARKER, EOS = 3, 1  # `</think>` and `<eos>` in the tiny tokenizer
FEATURES = ("prompt", "reasoning", "entropy", "length")


def toy_reward(completions: list[str], prompts: list[str], **kwargs) -> list[float]:
    """Mostly set by the prompt's first digit, sometimes flipped by a digit in the completion: values differ across
    prompts and, for some prompts, across rollouts."""
    return [float(int(p[0]) + sum(ch.isdigit() for ch in c) >= 5) for p, c in zip(prompts, completions, strict=True)]


def _quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval(), AutoTokenizer.from_pretrained(tiny_model_path)


def _reference_features(model, prompt: list[int], completion: list[int], layer: int, n: int) -> torch.Tensor:
    """φ of one row from an unpadded `output_hidden_states` pass, written from the paper's definition (§3) without
    poise_trl.features.features: last-n prompt / reasoning means, entropy over completion / reasoning / answer,
    length."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt + completion]), output_hidden_states=True)
    hidden, p, c = out.hidden_states[layer + 1][0], len(prompt), len(completion)
    logp = out.logits[0, p - 1 : p + c - 1].log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    markers = [j for j, token in enumerate(completion) if token == MARKER]
    end = markers[-1] if markers else c - 1
    answer = list(range(end + 1, c)) if markers else list(range(max(0, c - n), c))
    stats = [entropy.mean(), entropy[: end + 1].mean(), entropy[answer].mean() if answer else torch.tensor(0.0)]
    return torch.cat(
        [
            hidden[max(0, p - n) : p].mean(0),
            hidden[p + max(0, end + 1 - n) : p + end + 1].mean(0),
            torch.stack(stats),
            torch.tensor([float(c)]),
        ]
    )


def test_one_pass_features_of_every_layer_and_window_match_the_definition(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    prompts = ["12=", "4567890=", "3+3="]  # different lengths: left padding inside the batch
    completions = [
        [5, 6, MARKER, 7, EOS],  # marker, then the answer, then EOS
        [MARKER, 8, 9],  # truncated: no EOS
        [6, 7, 8, 9, 10, 11, EOS],  # no marker: reasoning = whole completion, answer = last n tokens
        [5, MARKER, 6, MARKER, EOS],  # the LAST marker ends the reasoning
        [5, EOS, 9, 9],  # sampled past EOS: cut after EOS
        [7, 7, 7, MARKER],  # marker last: empty answer span
    ]
    collection = collect(
        model,
        tokenizer,
        prompts,
        lambda completions, **kwargs: [1.0, 0.0] * 3,
        k=2,
        layers=[0, 1],  # not the last layer: transformers applies the final norm to hidden_states[-1], not the hook
        pools=[2],
        pool_tokens=3,
        feature_batch_size=4,  # rows of one prompt straddle two passes
        completions=completions,
        log=_quiet,
    )
    assert collection.captures == [(0, 3), (1, 3), (2, 3), (2, 2)]  # layer sweep at n=3, window sweep at layer 2
    assert collection.features.shape == (6, 4, 2 * 128 + 4)
    assert collection.completion_ids[4][collection.completion_mask[4]].tolist() == [5, EOS]
    for row, completion in enumerate(completions):
        completion = completion[:2] if row == 4 else completion
        prompt = tokenizer(prompts[row // 2], add_special_tokens=False)["input_ids"]
        for layer, pool in collection.captures:
            expected = _reference_features(model, prompt, completion, layer, pool)
            torch.testing.assert_close(
                collection.columns(list(FEATURES), layer, pool)[row], expected, atol=1e-4, rtol=1e-4
            )
            # A block subset is the same columns as assembling only those blocks: [reasoning | length].
            subset = collection.columns(["length", "reasoning"], layer, pool)[row]
            torch.testing.assert_close(subset, torch.cat([expected[128:256], expected[-1:]]), atol=1e-4, rtol=1e-4)
    loaded = Collection.load(collection.save(tmp_path / "c.safetensors"))
    assert torch.equal(loaded.features, collection.features) and loaded.meta == collection.meta


def _synthetic(num_prompts: int = 12, k: int = 4, seed: int = 0) -> Collection:
    """Random features and binary rewards in the collection layout, one capture (layer 0, pool 10), d = 40."""
    g = torch.Generator().manual_seed(seed)
    n = num_prompts * k
    rewards = (torch.rand(n, generator=g) < torch.rand(num_prompts, generator=g).repeat_interleave(k)).float()
    rewards[5] = float("nan")  # an unscorable rollout
    return Collection(
        features=torch.randn(n, 1, 2 * 40 + 4, generator=g),
        rewards=rewards,
        prompt_index=torch.arange(num_prompts).repeat_interleave(k),
        prompt_ids=torch.ones(num_prompts, 3, dtype=torch.long),
        prompt_mask=torch.ones(num_prompts, 3, dtype=torch.long),
        completion_ids=torch.ones(n, 2, dtype=torch.int32),
        completion_mask=torch.ones(n, 2, dtype=torch.bool),
        meta={"k": k, "hidden_size": 40, "captures": [[0, 10]], "default_layer": 0, "default_pool": 10},
    )


def test_leave_one_out_target_never_includes_the_rows_own_reward():
    collection = _synthetic()
    targets = ValueBenchmark(collection).targets
    rewards = collection.rewards.view(-1, 4)
    for i in range(collection.rewards.numel()):
        others = torch.cat([rewards[i // 4, : i % 4], rewards[i // 4, i % 4 + 1 :]])
        torch.testing.assert_close(targets[i], others.nanmean())
        flipped = _synthetic()
        flipped.rewards[i] = 1.0 - flipped.rewards[i] if i != 5 else 1.0
        changed = ValueBenchmark(flipped).targets
        assert changed[i] == targets[i]  # the row's own reward does not move its target...
        group = torch.arange(i // 4 * 4, i // 4 * 4 + 4)
        assert (changed[group[group != i]] != targets[group[group != i]]).all()  # ...but moves its partners'
    bench = ValueBenchmark(collection)
    assert not bench.fit_rows[5], "a rollout without a reward is not a training example, as in the trainer"


def test_split_is_by_prompt_and_held_out_rewards_never_reach_the_fit(tmp_path):
    train, test = split_by_prompt(40, 0.25, seed=3)
    assert len(test) == 10 and set(train.tolist()).isdisjoint(test.tolist())
    assert sorted(train.tolist() + test.tolist()) == list(range(40))
    collection = _synthetic(num_prompts=40)
    bench = ValueBenchmark(collection, seed=3)
    assert torch.equal(bench.test_prompts, test)
    train_prompts = set(collection.prompt_index[bench.train_rows].tolist())
    assert train_prompts.isdisjoint(collection.prompt_index[bench.test_rows].tolist())
    assert (bench.train_rows ^ bench.test_rows).all()  # every rollout on exactly one side, with its prompt

    altered = _synthetic(num_prompts=40)
    altered.rewards[bench.test_rows] = 1.0 - altered.rewards[bench.test_rows].nan_to_num(0.0)
    other = ValueBenchmark(altered, seed=3)
    for preset in ("release", "paper"):
        assert torch.equal(
            bench.probe_preset(["prompt", "entropy"], preset), other.probe_preset(["prompt", "entropy"], preset)
        )
    assert torch.equal(bench.train_mean(), other.train_mean())
    assert not (bench.avg_at_k == other.avg_at_k).all()  # only the held-out targets changed

    rows = [{"problem": p, "answer": "1"} for p in ("1+1", "2+2", "1+1", "3+3", "2+2", "4+4")]
    path = tmp_path / "dup.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    prompts, columns = load_prompts(str(path), num_prompts=4, seed=0, split=None)
    assert len({json.dumps(p) for p in prompts}) == 4 == len(columns["answer"])  # duplicates would straddle the split

    # a `save_to_disk` folder (a demo's training split) gives its prompts as the run saw them, so their ids match
    train, _ = make_arith_splits(num_train=12, num_eval=4, seed=0)
    train.save_to_disk(str(tmp_path / "train"))
    prompts, columns = load_prompts(str(tmp_path / "train"), num_prompts=5, seed=0, split=None)
    assert set(prompt_group_ids(prompts).tolist()) <= set(prompt_group_ids(list(train["prompt"])).tolist())
    assert len(prompts) == 5 and set(columns) == {"answer", "family"}


def test_critic_trains_and_predicts_in_unit_interval(tiny_model_path, model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    texts = [f"{'1' * (1 + i % 4)}{i}=" for i in range(10)] + [f"{'9' * (1 + i % 4)}{i}=" for i in range(10)]
    encoded = tokenizer(texts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    targets = torch.tensor([1.0] * 10 + [0.0] * 10)
    torch.manual_seed(0)
    critic = load_critic(tiny_model_path, init_value=0.5)
    history = train_critic(critic, ids, mask, targets, epochs=6, lr=3e-3, batch_size=10, validation_fraction=0.0)
    values = predict_critic(critic, ids, mask)
    assert ((values >= 0) & (values <= 1)).all()
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert values[:10].mean() > values[10:].mean() + 0.3, values
    alone = predict_critic(critic, ids[:1, mask[0].bool()], mask[:1, mask[0].bool()])  # no padding at all
    torch.testing.assert_close(alone, values[:1], atol=1e-4, rtol=1e-4)


def _run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_probe_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["probe-bench", *argv])
    assert args.func(args, log=_quiet) == 0
    return json.loads((Path(args.output_dir) / "results.json").read_text())


def test_command_end_to_end_refit_without_generation_and_export_warm_starts_the_trainer(tiny_model_path, tmp_path):
    out, probe_file = tmp_path / "bench", tmp_path / "probe.safetensors"
    common = ["--reward-fn", "tests.lab.bench.test_probe_bench:toy_reward", "--mlps", "1x8", "--bootstrap", "50"]
    common += ["--device", "cpu", "--seed", "1", "--pool-tokens", "3"]
    results = _run(
        [str(tiny_model_path), "--dataset", "sort", "--num-prompts", "16", "--k", "4", "--max-new-tokens", "6"]
        + ["--layers", "1,3", "--pools", "2", "--critic-epochs", "2", "--output-dir", str(out)]
        + ["--export", str(probe_file), *common]
    )
    assert str(tmp_path) not in json.dumps(results) and "model_path" not in results["collection"]  # no machine paths
    sections = results["sections"]
    assert list(sections) == [
        "Probe vs critic",
        "Feature ablation",
        "Layer sweep",
        "Pooling window",
        "Probe architecture",
    ]
    names = [row["name"] for row in sections["Probe vs critic"]]
    assert names[:3] == [
        "POISE probe (release preset)",
        "POISE probe (paper preset)",
        "Critic (policy backbone + value head, BCE)",
    ]
    *sweep, auto = sections["Layer sweep"]
    assert [row["layer"] for row in sweep] == [1, 2, 3]
    # The trainer's probe_layer="auto" rule on the train rows: one cross-validated MAE per candidate, then a choice.
    assert auto["candidates"] == [1, 2, 3] and len(auto["cv_mae"]) == 3 and auto["layer"] in auto["candidates"]
    assert auto["name"] == f"auto: {auto['layer']} of [1, 2, 3]"
    chosen = next(row for row in sweep if row["layer"] == auto["layer"])
    assert auto["pearson_r"] == chosen["pearson_r"]  # scored exactly as the fixed layer it picked
    assert [row["pool"] for row in sections["Pooling window"]] == [2, 3]
    # the trainer's other value heads by default, on the ridge row's front end, before the sklearn MLPs
    arch = [row["name"] for row in sections["Probe architecture"]]
    heads = [f"probe_head={h} (release preset)" for h in ("logistic", "mlp", "ensemble", "pca_ridge")]
    assert arch == ["Linear ridge (release preset)", *heads, "MLP 1x8"]
    for row in sections["Probe architecture"][1:5]:
        assert 0 <= row["mae"] <= 1 and -1 <= row["pearson_r"] <= 1 and row["mae_ci"][0] <= row["mae_ci"][1]
    critic = sections["Probe vs critic"][2]
    assert all(0 <= v <= 1 for v in critic["per_prompt_prediction"])
    for row in sections["Probe vs critic"][:2] + sections["Feature ablation"]:
        assert 0 <= row["mae"] <= 1 and -1 <= row["pearson_r"] <= 1 and row["mae_ci"][0] <= row["mae_ci"][1]
    assert (out / "results.md").read_text().count("| MAE ↓ |") == 5 and (out / "figure1.png").stat().st_size > 0

    refit = _run(
        [
            "--from-collection",
            str(out / "collection.safetensors"),
            "--no-critic",
            "--output-dir",
            str(tmp_path / "refit"),
            *common,
        ]
    )

    def scores(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in row.items() if k != "fit_seconds"} for row in rows]

    assert scores(refit["sections"]["Feature ablation"]) == scores(sections["Feature ablation"])

    args = POISEConfig(
        **CPU_ARGS, output_dir=str(tmp_path / "t"), probe_pool_tokens=3, probe_init_path=str(probe_file)
    )
    trainer = POISETrainer(
        str(tiny_model_path), toy_reward, args=args, train_dataset=Dataset.from_dict({"prompt": ["12="] * 4})
    )
    trainer.save_probe(tmp_path / "resaved.safetensors", include_buffer=False)
    exported, resaved = load_file(str(probe_file)), load_file(str(tmp_path / "resaved.safetensors"))
    assert exported.keys() == resaved.keys() and all(torch.equal(exported[k], resaved[k]) for k in exported)
    # the trainer writes the estimator's one file; the export keeps the 0.1 layout, which reads back the same
    info = read_state(tmp_path / "resaved.safetensors")["info"]
    assert info["feature_config"] == read_state(probe_file)["info"]["feature_config"]


def test_beyond_the_paper_tables_on_a_collection_with_a_value_signal():
    """Rewards follow a per-prompt success rate that the prompt block carries: the value-guided choice must keep
    prompts of higher true p(1 - p) than random ones, and each VR row must be the split's own number."""
    from poise_lab.bench.value.beyond import format_beyond, run_beyond, selection_trials
    from poise_lab.bench.value.score import ValueBenchmark

    collection = _synthetic(num_prompts=40, k=4)
    g = torch.Generator().manual_seed(1)
    p = torch.rand(40, generator=g)
    collection.rewards = (torch.rand(160, generator=g) < p.repeat_interleave(4)).float()
    collection.features[:, :, :8] += 3 * p.repeat_interleave(4).view(-1, 1, 1)  # prompt block: the success rate
    out = run_beyond(collection, ["prompt", "reasoning", "entropy"], "paper", 0.25, 0, splits=2, trials=20)
    rules = out["baseline_rules"]
    assert rules["RLOO"]["per_split"] == [ValueBenchmark(collection, 0.25, s).variance_reduction(None) for s in (0, 1)]
    assert 0 <= rules["shrunk weight w"]["median"] < 1
    assert len(rules["partner-aware probe h(φ_j, r_j)"]["per_split"]) == 2

    truth = np.linspace(0, 1, 21)
    exact = selection_trials(truth, truth, batch_prompts=5, oversample=2.0, trials=50, seed=0)
    assert exact["value: top-k"]["mean p(1-p)"] > exact["random"]["mean p(1-p)"]
    assert exact["value: top-k"]["degenerate share"] == 0 < exact["random"]["degenerate share"]
    lines = "\n".join(format_beyond(out))
    assert "| shrunk RLOO |" in lines and "| value: top-k |" in lines


def test_variance_reduction_interval_pools_the_resampled_prompts_rollouts():
    """Each resample's VR is the pooled formula over its prompts' rollouts: the identity resample gives the point
    estimate exactly, a resample of one prompt twice gives that prompt's own VR, and the interval holds the point."""
    from poise_lab.bench.value.score import ValueBenchmark

    collection = _synthetic(num_prompts=40, k=4)
    g = torch.Generator().manual_seed(2)
    p = torch.rand(40, generator=g)
    collection.rewards = (torch.rand(160, generator=g) < p.repeat_interleave(4)).float()
    bench = ValueBenchmark(collection, 0.25, seed=0, n_bootstrap=200)
    values = (p.repeat_interleave(4) + 0.1 * torch.randn(160, generator=g))[bench.test_rows]  # held-out rows
    point = bench.variance_reduction(values)
    low, high = bench.variance_reduction_ci(values)
    assert low <= point <= high and low < high

    scored = int(bench.scored.sum())
    bench.bootstrap_index = np.arange(scored)[None].repeat(2, 0)  # two identity resamples
    assert bench.variance_reduction_ci(values) == pytest.approx([point, point], abs=1e-12)
    r, b, _ = bench._held_out_baselines(values)
    mixed = next(i for i in range(scored) if 0 < r[i].mean() < 1)  # a prompt whose rewards vary
    bench.bootstrap_index = np.full((2, scored), mixed)
    a = (r[mixed] - b[mixed]).numpy()
    own = 1 - a.var() / r[mixed].numpy().var()
    assert bench.variance_reduction_ci(values) == pytest.approx([own, own], abs=1e-12)


def test_variance_reduction_bound_is_the_true_value_baselines_on_held_out_prompts():
    """With rewards drawn from known per-prompt rates, the bound matches 1 - mean p(1-p) / Var(r) on the held-out
    prompts, and a probe given the true rates gets no more than it (up to sampling noise)."""
    from poise_lab.bench.value.score import ValueBenchmark

    collection = _synthetic(num_prompts=400, k=8)
    g = torch.Generator().manual_seed(3)
    p = torch.rand(400, generator=g)
    collection.rewards = (torch.rand(3200, generator=g) < p.repeat_interleave(8)).float()
    bench = ValueBenchmark(collection, 0.25, seed=0)
    held_out = p.repeat_interleave(8)[bench.test_rows]
    r = collection.rewards[bench.test_rows]
    expected = 1 - (held_out * (1 - held_out)).mean() / r.var(unbiased=False)
    assert bench.variance_reduction_bound() == pytest.approx(expected.item(), abs=0.03)
    assert bench.variance_reduction(held_out) <= bench.variance_reduction_bound() + 0.03


def test_pair_fitted_probe_learns_from_partner_rewards_as_the_online_buffer_does(monkeypatch):
    """One pair a prompt: the fit sees 2 rows per train prompt (the first two rollouts), each with its partner's
    reward as target; all pairs: K rows per prompt with partner targets, never the mean of the K - 1 others."""
    from poise_lab.bench.value.beyond import pair_fitted_probe
    from poise_lab.bench.value.score import ValueBenchmark
    from poise_trl.heads.probe import ValueProbe

    collection = _synthetic(num_prompts=20, k=4)
    collection.rewards = torch.tensor([1.0, 0.0, 1.0, 1.0] * 20)
    bench = ValueBenchmark(collection, 0.25, seed=0)
    seen = []
    fit = ValueProbe.fit
    monkeypatch.setattr(ValueProbe, "fit", lambda self, x, y: (seen.append(y.clone()), fit(self, x, y))[1])
    pair_fitted_probe(bench, ["prompt"], "paper", 1)
    pair_fitted_probe(bench, ["prompt"], "paper", None)
    train = len(bench.train_prompts)
    assert seen[0].tolist() == [0.0, 1.0] * train  # rollout 0's partner is 1 (reward 0), and the reverse
    assert seen[1].tolist() == [0.0, 1.0, 1.0, 1.0] * train  # pairs (0, 1) and (2, 3)


def test_probe_heads_default_to_every_other_head_and_refuse_unknown_names():
    from poise_lab.bench.common import other_heads as probe_heads

    assert probe_heads(None) == ["logistic", "mlp", "ensemble", "pca_ridge"] and probe_heads([]) == []
    assert probe_heads(["ridge", "mlp"]) == ["mlp"]  # ridge is the preset row already
    with pytest.raises(SystemExit, match="choose among ridge, logistic, mlp, ensemble, pca_ridge"):
        probe_heads(["sigmoid"])
