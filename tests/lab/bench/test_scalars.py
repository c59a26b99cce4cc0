"""Pools' per-token record and `bench scalars`: the record is the features' own pass (its entropies average to the
stored statistics, its log-probabilities are the model's), a later pass adds it only with the sampling model, and
the harness's default rows are `bench gradient`'s committed ones while an extra column moves only its own rows."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from poise_lab.bench import scalars as scalars_module
from poise_lab.bench.pool_tokens import block_differences, teacher_force
from poise_lab.bench.scalars import (
    SCALAR_SETS,
    PoolRollouts,
    Variant,
    completion_length,
    entropy_stats,
    load_column_fn,
    load_tokenizer,
    measure_rows,
    scalar_set,
    weighted_pearson,
    with_tokenizer,
)
from poise_lab.bench.value.collect import Collection, collect, tokens_path
from poise_lab.models import real
from poise_trl import cli
from poise_trl.choices import DEFAULT_PRESET
from poise_trl.features.columns import DEFAULT_SCALARS, REFERENCE_SCALARS, SCALARS, Scalar, scalar_columns
from poise_trl.features.features import FeatureLayout, feature_spans
from poise_trl.tiny import save_tiny

ROOT = Path(__file__).resolve().parents[3]
START_POOL = ROOT / "benchmarks/real-lm/pools/gradient/smollm2-135m-9110f0f21f42"
START_RESULTS = ROOT / "benchmarks/real-lm/gradient/start-heads/results.json"
TOY_POOL = ROOT / "benchmarks/gradient-toy-pools/gradient/demo-e73758a85160"


def library_entropy_statistics(rollouts: PoolRollouts) -> torch.Tensor:
    """(N, 3) the row's own entropy statistics, recomputed by the library's function from the per-token record."""
    return scalar_columns(DEFAULT_SCALARS, rollouts.entropies, rollouts.spans)


def wrong_shape(rollouts: PoolRollouts) -> torch.Tensor:
    return torch.zeros(3, 1)


def parity_reward(completions: list[str], **kwargs) -> list[float]:
    return [float(sum(map(ord, c)) % 2) for c in completions]


def _collect(path: Path, num_prompts: int, k: int, seed: int = 0) -> Collection:
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = [f"{i}{(7 * i) % 10}+{i % 3}" for i in range(num_prompts)]
    return collect(
        model,
        tokenizer,
        prompts,
        parity_reward,
        k=k,
        layers=[1],
        pools=[],
        layer=1,
        pool_tokens=3,
        max_new_tokens=6,
        temperature=0.7,
        feature_batch_size=5,
        seed=seed,
        meta={"model_path": str(path)},
        log=lambda _: None,
    )


def test_a_pool_keeps_the_entropies_and_log_probabilities_of_its_features_pass(tiny_model_path, tmp_path):
    pool = _collect(tiny_model_path, 6, 3)
    tokens = pool.tokens
    assert tokens.entropies.shape == pool.completion_ids.shape == tokens.logprobs.shape
    assert (tokens.entropies[~pool.completion_mask] == 0).all() and (tokens.entropies[pool.completion_mask] > 0).all()
    # the stored entropy statistics are these entropies averaged over the library's spans
    spans = PoolRollouts.of(pool).spans
    start, stop = FeatureLayout(tuple(pool.meta["feature_blocks"])).slices(pool.meta["hidden_size"])["entropy"]
    for column, mask in enumerate((spans.completion_mask, spans.reasoning_mask, spans.answer_mask)):
        mean = (tokens.entropies * mask).sum(1) / mask.sum(1).clamp(min=1)
        torch.testing.assert_close(pool.features[:, 0, start + column], mean, atol=1e-6, rtol=1e-6)
    # the log-probabilities are the model's own at the sampling temperature, token by token
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    prompts, completions = pool.rows()
    for row in (0, 7, 17):
        ids = torch.tensor([prompts[row] + completions[row]])
        logits = model(input_ids=ids).logits[0, len(prompts[row]) - 1 : -1] / 0.7
        expected = logits.log_softmax(-1).gather(1, torch.tensor(completions[row])[:, None])[:, 0]
        torch.testing.assert_close(tokens.logprobs[row, : len(completions[row])], expected, atol=1e-5, rtol=1e-5)
    assert tokens.texts[0] == AutoTokenizer.from_pretrained(tiny_model_path).decode(
        completions[0], skip_special_tokens=True
    )
    # saved beside the collection; a collection saved before pools kept them loads without
    path = pool.save(tmp_path / "pool.safetensors")
    assert tokens_path(path) == tmp_path / "pool.tokens.safetensors" and tokens_path(path).exists()
    loaded = Collection.load(path)
    assert torch.equal(loaded.tokens.entropies, tokens.entropies) and loaded.tokens.texts == tokens.texts
    assert loaded.tokens.marker_ids == tokens.marker_ids and loaded.tokens.source == tokens.source
    tokens_path(path).unlink()
    old = Collection.load(path)
    assert old.tokens is None and torch.equal(old.features, pool.features)
    with pytest.raises(SystemExit, match="bench pool-tokens"):
        PoolRollouts.of(old)


def test_pool_tokens_adds_the_record_only_with_the_model_that_sampled_the_pool(tiny_model_path, tmp_path, capsys):
    folder = tmp_path / "pool-folder"
    made = {"pool": _collect(tiny_model_path, 6, 3), "probe_pool": _collect(tiny_model_path, 8, 2, seed=1)}
    for name, collection in made.items():
        Collection(**{**vars(collection), "tokens": None}).save(folder / f"{name}.safetensors")
    other = save_tiny(tmp_path / "other", num_layers=2, seed=1)
    assert cli.main(["bench", "pool-tokens", str(folder), "--model", str(other), "--batch-size", "5"]) == 1
    assert "refused" in capsys.readouterr().out and not list(folder.glob("*.tokens.safetensors"))
    assert cli.main(["bench", "pool-tokens", str(folder), "--batch-size", "5"]) == 0  # the pool's own model_path
    for name, collection in made.items():
        added = Collection.load(folder / f"{name}.safetensors").tokens
        assert max(added.source["max_abs_difference"].values()) < 1e-5
        torch.testing.assert_close(added.entropies, collection.tokens.entropies, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(added.logprobs, collection.tokens.logprobs, atol=1e-5, rtol=1e-5)
        assert added.texts == collection.tokens.texts and added.marker_ids == collection.tokens.marker_ids
    # another batching pads rows differently: the blocks still agree, so the check is not a bitwise one
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path, padding_side="left")
    _, differences = teacher_force(made["pool"], model, tokenizer, batch_size=4)
    assert set(differences) == {"prompt", "reasoning", "entropy", "length"} and max(differences.values()) < 1e-4
    assert block_differences(made["pool"].features, made["pool"].features + 1, 128)["length"] == 1.0


def test_the_scalars_cut_from_the_decoded_text_get_the_tokenizer_of_the_pool_only_when_asked(tiny_model_path):
    """A `--probe-scalars` set of `text_*` scalars is given the sampling model's tokenizer (and refused without one,
    or with a path that holds none), and its columns are the library's with that tokenizer; other sets load none."""
    pool = _collect(tiny_model_path, 4, 2)
    reference, paper = scalar_set("reference=" + ",".join(REFERENCE_SCALARS)), scalar_set("paper=paper")
    assert "text_reasoning_mean_token_entropy" not in SCALAR_SETS["entropy12"] and len(SCALAR_SETS["entropy12"]) == 12
    with pytest.raises(ValueError, match="'text_reasoning_mean_token_entropy' cuts its span from the decoded text"):
        reference.rows(pool, ["prompt", "entropy"])
    assert with_tokenizer([paper], "/no/such/model") == [paper]  # nothing to load
    with pytest.raises(SystemExit, match="give it with --tokenizer PATH"):
        with_tokenizer([paper, reference], "/no/such/model")
    given = with_tokenizer([paper, reference], str(tiny_model_path))
    assert given[0].tokenizer is given[1].tokenizer is not None
    rows = given[1].rows(pool, ["prompt", "entropy"])
    rollouts = PoolRollouts.of(pool)
    spans = feature_spans(
        rollouts.prompt_mask,
        rollouts.completion_ids,
        rollouts.completion_mask,
        int(pool.meta["default_pool"]),
        pool.tokens.marker_ids,
        tokenizer=AutoTokenizer.from_pretrained(tiny_model_path),
    )
    expected = scalar_columns(REFERENCE_SCALARS, rollouts.entropies, spans)
    assert torch.equal(rows[:, -3:], expected) and all(SCALARS[name].reads_text for name in REFERENCE_SCALARS[1:])


def test_weighted_pearson_is_pearson_on_the_resampled_prompts():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=9), rng.normal(size=9)
    counts = np.stack([np.ones(9), np.bincount(rng.integers(9, size=9), minlength=9)]).astype(float)
    got = weighted_pearson(x, y, counts)
    assert got[0] == pytest.approx(np.corrcoef(x, y)[0, 1])
    repeated = np.repeat(np.arange(9), counts[1].astype(int))
    assert got[1] == pytest.approx(np.corrcoef(x[repeated], y[repeated])[0, 1])


def test_measure_rows_pairs_each_variant_with_its_default():
    rng = np.random.default_rng(1)
    rewards = (rng.random((10, 4)) < rng.random((10, 1))).astype(float)
    scores = rng.normal(size=(40, 6))
    grams = {"lora": torch.from_numpy(scores @ scores.T), "norms": torch.from_numpy(scores[:, :3] @ scores[:, :3].T)}
    good = np.clip(rewards.mean(1, keepdims=True) + 0.05 * rng.normal(size=(10, 4)), 0, 1).ravel()
    values = {"poise:default": np.full(40, rewards.mean()) + 0.01 * rng.normal(size=40), "poise:better": good}
    out = measure_rows(rewards, values, grams, 30, 0)
    assert set(out["held_out_r_paired"]) == {"poise:better"}
    for subspace in grams:
        block = out[subspace]
        assert set(block["M_paired"]) == {"poise:better"}
        for row in values:  # M is the variance above the oracle's, resample by resample
            assert block["M"][row]["value"] == pytest.approx(
                block["variance"][row]["value"] - block["oracle_variance"]["value"]
            )
        assert block["M_paired"]["poise:better"]["value"] == pytest.approx(
            block["M"]["poise:better"]["value"] - block["M"]["poise:default"]["value"]
        )
        assert block["M"]["poise:better"]["value"] < block["M"]["poise:default"]["value"]
    assert out["held_out_r"]["poise:better"]["value"] > 0.9


def test_bad_columns_are_refused_with_what_to_change():
    with pytest.raises(SystemExit, match="unknown: no_such_scalar"):
        scalar_set("x=paper,no_such_scalar")
    with pytest.raises(SystemExit, match="NAME=ENTRY,ENTRY"):
        scalar_set("default=paper")
    assert (
        scalar_set("x=paper,output_mean_token_entropy,length").columns.names == DEFAULT_SCALARS + SCALAR_SETS["length"]
    )
    with pytest.raises(SystemExit, match="NAME=MODULE:FUNCTION"):
        load_column_fn("poise_lab.bench.scalars:completion_length")
    with pytest.raises(SystemExit, match="NAME=MODULE:FUNCTION"):
        load_column_fn("default=poise_lab.bench.scalars:completion_length")
    with pytest.raises(SystemExit, match="no_such_function"):
        load_column_fn("x=poise_lab.bench.scalars:no_such_function")
    pool = Collection.load(START_POOL / "pool.safetensors")
    with pytest.raises(ValueError, match=r"variant 'bad'.*\(512, k\)"):
        Variant("bad", wrong_shape).rows(pool, ["entropy"])


def test_scalars_on_a_committed_pool_reproduce_bench_gradient_and_move_only_the_variants(tmp_path):
    """The committed start pool (its per-token record added by `bench pool-tokens`): the record agrees with the stored
    rows, the default rows are `bench gradient`'s POISE (paper) and POISE (default) to the last digit, and the
    oracle's too; a variant's columns move its own rows, and the row's statistics recomputed in their own place
    (`--replace-scalars`) give the default row's values."""
    pool = Collection.load(START_POOL / "pool.safetensors")
    rollouts = PoolRollouts.of(pool)
    start, stop = FeatureLayout(tuple(pool.meta["feature_blocks"])).slices(pool.meta["hidden_size"])["entropy"]
    torch.testing.assert_close(entropy_stats(rollouts)[:, 0], pool.features[:, 0, start], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(completion_length(rollouts)[:, 0], pool.features[:, 0, stop])  # the length block
    out = tmp_path / "scalars"
    columns = [
        "length=poise_lab.bench.scalars:completion_length",
        "entropy=poise_lab.bench.scalars:entropy_stats",
    ]
    same = "same=tests.lab.bench.test_scalars:library_entropy_statistics"
    argv = ["bench", "scalars", str(START_POOL), "--columns", *columns, "--replace-scalars", same]
    argv += ["--probe-scalars", "paper=paper", "twelve=entropy12"]
    argv += ["--bootstrap", "20", "--output-dir", str(out)]
    assert cli.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    committed = json.loads(START_RESULTS.read_text())
    presets = ("poise_paper", "poise")
    variants = ("default", "length", "entropy", "same", "paper", "twelve")
    rows = {f"{preset}:{variant}" for preset in presets for variant in variants}
    for subspace in ("lora", "norms"):
        block = results["measured"][subspace]
        assert set(block["variance"]) == rows
        assert set(block["M_paired"]) == rows - {f"{preset}:default" for preset in presets}
        for preset in presets:
            expected = committed["subspaces"][subspace]["table"][preset]["variance"]["value"]
            assert block["variance"][f"{preset}:default"]["value"] == pytest.approx(expected, rel=1e-12)
            oracle = committed["subspaces"][subspace]["table"]["oracle"]["variance"]["value"]
            assert block["oracle_variance"]["value"] == pytest.approx(oracle, rel=1e-12)
            default = block["variance"][f"{preset}:default"]["value"]
            assert block["variance"][f"{preset}:entropy"]["value"] != pytest.approx(default, rel=1e-6)
            # the default row with its statistics recomputed from the record in their place: the same probe
            assert block["variance"][f"{preset}:same"]["value"] == pytest.approx(default, rel=1e-4)
            # the paper's three as a probe_scalars list: the same row again; the 12 statistics: another probe
            assert block["variance"][f"{preset}:paper"]["value"] == pytest.approx(default, rel=1e-4)
            assert block["variance"][f"{preset}:twelve"]["value"] != pytest.approx(default, rel=1e-6)
    r = results["measured"]["held_out_r"]
    assert all(-1 <= cell["value"] <= 1 for cell in r.values())
    assert results["pool"]["tokens"]["pass"].startswith("teacher-forced")
    assert "POISE (default) G=2 [entropy]" in (out / "results.md").read_text()


def test_every_named_set_lists_scalars_of_the_library_and_every_scalar_is_in_a_set():
    for name, names in SCALAR_SETS.items():
        assert names and len(set(names)) == len(names), name
        assert not set(names) - set(SCALARS), (
            f"{name}: {set(names) - set(SCALARS)} not in poise_trl.features.columns.SCALARS"
        )
    assert SCALAR_SETS["paper"] == DEFAULT_SCALARS
    assert len(SCALAR_SETS["entropy12"]) == 12 and len(SCALAR_SETS["all"]) == 26
    assert SCALAR_SETS["reference"] == REFERENCE_SCALARS
    # `all` is the official code's 26 (the scalars computed from token ids); the reference's text scalars have their
    # own set. A scalar added to the library must be placed in a set (and a set it joins re-measured).
    assert SCALAR_SETS["all"] == tuple(name for name, scalar in SCALARS.items() if not scalar.reads_text)
    placed = {name for names in SCALAR_SETS.values() for name in names}
    assert placed == set(SCALARS), f"list {set(SCALARS) - placed} in SCALAR_SETS"


def test_a_scalar_added_to_the_library_changes_no_named_set(monkeypatch):
    """The sets are read again from the module's source with one more token-entropy statistic (and a repetition
    feature) in `SCALARS`: a set chosen by name suffix or substring would take them in."""
    before = {name: tuple(names) for name, names in SCALAR_SETS.items()}
    extra = Scalar("the median token entropy over the output span", lambda entropies, spans: entropies[:, 0])
    monkeypatch.setitem(SCALARS, "output_median_token_entropy", extra)
    monkeypatch.setitem(SCALARS, "answer_repetition_ratio", extra)
    spec = importlib.util.spec_from_file_location("poise_lab.bench._scalars_again", scalars_module.__file__)
    again = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(again)
    assert again.SCALAR_SETS == before


def test_each_probe_holds_its_own_scalars_and_every_row_pairs_with_the_against_row(tmp_path, capsys):
    """`--probes` on the committed toy pool: the reference preset's default row is its own (the text scalars, cut
    with the toy's tokenizer named `demo`), POISE (default)'s the stored one; `--against` pairs every other row with
    one row on the same resamples, beside each row's own default; the record names each probe's preset and scalars,
    and a row that is not one of the run's is refused."""
    out = tmp_path / "probes"
    argv = ["bench", "scalars", str(TOY_POOL), "--probes", "poise", "poise_reference", "reference_ridge"]
    argv += ["--probe-scalars", "paper3=paper", "text=reference", "--tokenizer", "demo", "--bootstrap", "20"]
    assert cli.main([*argv, "--against", "poise_reference:default", "--output-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    measured = results["measured"]
    assert results["probes"]["poise"]["probe_preset"] == DEFAULT_PRESET
    assert results["probes"]["poise_reference"]["scalars"] == list(REFERENCE_SCALARS)
    assert results["probes"]["reference_ridge"]["settings"] == {"probe_preset": "reference", "probe_head": "ridge"}
    assert results["settings"]["against"] == "poise_reference:default"
    for subspace in ("lora", "norms"):
        block = measured[subspace]
        variance = {row: cell["value"] for row, cell in block["variance"].items()}
        # each probe's default row is its own: the reference's holds the text scalars, the default's the paper's
        assert variance["poise_reference:text"] == variance["poise_reference:default"]
        assert variance["poise_reference:paper3"] != pytest.approx(variance["poise_reference:default"], rel=1e-6)
        assert variance["poise:paper3"] == pytest.approx(variance["poise:default"], rel=1e-4)
        assert variance["poise:text"] != pytest.approx(variance["poise:default"], rel=1e-6)
        assert set(block["M_against"]) == set(variance) - {"poise_reference:default"}
        for row, cell in block["M_against"].items():  # the same resamples: the point difference of the two Ms
            assert cell["value"] == pytest.approx(
                block["M"][row]["value"] - block["M"]["poise_reference:default"]["value"]
            )
        assert block["M_against"]["poise_reference:paper3"] == block["M_paired"]["poise_reference:paper3"]
    r = measured["held_out_r"]
    assert measured["held_out_r_against"]["poise:default"]["value"] == pytest.approx(
        r["poise:default"]["value"] - r["poise_reference:default"]["value"]
    )
    assert "ΔM vs against (W)" in (out / "results.md").read_text()
    assert cli.main([*argv, "--against", "poise_paper:default", "--output-dir", str(tmp_path / "bad")]) != 0
    assert "--against poise_paper:default: not a row of this run" in capsys.readouterr().err


def test_the_tokenizer_is_named_by_the_model_bench_gradient_names(tiny_model_path, monkeypatch):
    """`demo` is the toy demo model's tokenizer, built without its warm start; a real model's name is prepared from
    its package (`resolve_model`); a folder is read as it is."""
    built = load_tokenizer("demo")
    saved = AutoTokenizer.from_pretrained(tiny_model_path)
    texts = ["2</think>666", "12 4</think>35"]
    assert built(texts)["input_ids"] == saved(texts)["input_ids"] and built.get_vocab() == saved.get_vocab()
    asked = []
    monkeypatch.setattr(real, "resolve_model", lambda name: asked.append(name) or str(tiny_model_path))
    assert load_tokenizer("smollm2-135m").get_vocab() == saved.get_vocab() and asked == ["smollm2-135m"]
