"""`poise-trl eval`: avg@k bookkeeping, backends and CLI, offline on a tiny model."""

import argparse
import json
import sys
import types
from pathlib import Path

import pytest

from poise_trl.rlvr import avg_at_k, evaluation
from poise_trl.rlvr.avg_at_k import _decode_completion, resolve_backend, score_benchmark, vllm_sampler
from poise_trl.rlvr.cli import add_eval_parser
from poise_trl.rlvr.evaluation import evaluate, format_table
from poise_trl.tasks.math_data import DEFAULT_BENCHMARKS, PAPER_BENCHMARKS, load_math_dataset
from poise_trl.tiny import build_tiny_tokenizer

BENCH = str(Path(__file__).parents[1] / "fixtures" / "tiny_bench.jsonl")


class RecordingReward:
    """A reward that depends on the completion text, and remembers every call, so avg@k can be recomputed."""

    def __init__(self):
        self.calls = []

    def __call__(self, completions, answer, **kwargs):
        rewards = [float(len(c[0]["content"]) % 2) for c in completions]
        self.calls.append({"completions": completions, "answer": answer, "rewards": rewards, **kwargs})
        return rewards


def test_auto_backend_uses_vllm_only_when_installed(monkeypatch):
    monkeypatch.setattr(avg_at_k, "vllm_available", lambda: False)
    assert resolve_backend("auto") == "hf"
    monkeypatch.setattr(avg_at_k, "vllm_available", lambda: True)
    assert resolve_backend("auto") == "vllm"


def test_vllm_backend_without_vllm_raises_a_clear_error(monkeypatch):
    monkeypatch.setattr(avg_at_k, "vllm_available", lambda: False)
    with pytest.raises(ImportError, match="needs vLLM"):
        resolve_backend("vllm")
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("sglang")


def test_vllm_sampler_asks_for_k_samples_per_prompt_with_the_protocol_settings(monkeypatch):
    """The vLLM path cannot run without CUDA: check what it sends to vLLM and how it reads the answer back."""
    created = {}

    class FakeTokenizer:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return messages[0]["content"] + "="

    class FakeLLM:
        def __init__(self, model, seed):
            created.update(model=model, seed=seed)

        def get_tokenizer(self):
            return FakeTokenizer()

        def generate(self, texts, params):
            created.update(texts=texts, params=params)
            return [
                types.SimpleNamespace(outputs=[types.SimpleNamespace(text=f"{t}{j}") for j in range(params.n)])
                for t in texts
            ]

    fake_vllm = types.ModuleType("vllm")
    fake_vllm.LLM = FakeLLM
    fake_vllm.SamplingParams = lambda **kwargs: types.SimpleNamespace(**kwargs)
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)

    sample = vllm_sampler("some/model", k=3, temperature=0.6, top_p=0.95, max_new_tokens=8192, seed=7)
    completions = sample([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]])
    assert completions == [["a=0", "a=1", "a=2"], ["b=0", "b=1", "b=2"]]
    assert created["model"] == "some/model" and created["seed"] == 7
    assert vars(created["params"]) == {"n": 3, "temperature": 0.6, "top_p": 0.95, "max_tokens": 8192}


def test_known_correct_completions_score_one_and_avg_at_k_averages_per_problem():
    dataset = load_math_dataset(BENCH)  # answers 2, 5, 8, 2

    def sampler(prompts):
        # Problem i gets i+1 correct completions out of k=4 (the last one: all 4).
        answers = ["2", "5", "8", "2"]
        return [
            [f"thinking</think>Answer: {answers[i] if j <= i else 'nope'}" for j in range(4)]
            for i in range(len(prompts))
        ]

    result = score_benchmark(sampler, dataset, k=4, reward_fn=evaluation.math_answer_reward)
    assert result["per_problem"] == [0.25, 0.5, 0.75, 1.0]
    assert result["avg_at_k"] == pytest.approx(0.625)
    assert result["pass_at_k"] == 1.0
    assert (result["num_problems"], result["num_samples"], result["unscored_samples"]) == (4, 16, 0)


def test_sampler_returning_the_wrong_number_of_completions_is_an_error():
    dataset = load_math_dataset(BENCH)
    with pytest.raises(RuntimeError, match="2 completions"):
        score_benchmark(
            lambda prompts: [["x"] for _ in prompts], dataset, k=2, reward_fn=evaluation.math_answer_reward
        )


def test_evaluate_tiny_model_with_hf_generate(tiny_model_path):
    reward = RecordingReward()
    result = evaluate(
        str(tiny_model_path),
        [BENCH, f"again={BENCH}"],
        k=2,
        max_new_tokens=6,
        reward_fn=reward,
        backend="hf",
        batch_size=3,
    )
    assert result["backend"] == "hf"
    assert (result["k"], result["temperature"], result["top_p"], result["max_new_tokens"]) == (2, 0.6, 0.95, 6)
    assert list(result["benchmarks"]) == ["tiny_bench", "again"]
    assert result["benchmarks"]["again"]["source"] == BENCH
    for call, bench in zip(reward.calls, result["benchmarks"].values(), strict=True):
        # TRL's convention: conversational completions, one row per sample, dataset columns repeated k times.
        assert len(call["completions"]) == 8 and all(c[0]["role"] == "assistant" for c in call["completions"])
        assert call["answer"] == ["2", "2", "5", "5", "8", "8", "2", "2"]
        assert call["prompts"][0] == call["prompts"][1] != call["prompts"][2]
        assert bench["avg_at_k"] == pytest.approx(sum(call["rewards"]) / 8)
        assert bench["rewards"] == [call["rewards"][i : i + 2] for i in range(0, 8, 2)]
        assert (bench["num_problems"], bench["num_samples"]) == (4, 8)
    means = [b["avg_at_k"] for b in result["benchmarks"].values()]
    assert result["mean"] == pytest.approx(sum(means) / 2)
    json.dumps(result)  # the result is written as JSON


def test_bad_arguments_are_rejected_before_loading_a_model():
    with pytest.raises(ValueError, match="unique"):
        evaluate("never/loaded", [BENCH, BENCH], backend="hf")
    with pytest.raises(ValueError, match="k must be"):
        evaluate("never/loaded", [BENCH], k=0, backend="hf")


def test_format_table_has_the_paper_layout():
    base = {
        "model": "base",
        "k": 32,
        "mean": 0.25,
        "benchmarks": {"AMC23": {"avg_at_k": 0.4219}, "AIME24": {"avg_at_k": 0.0781}},
    }
    tuned = {"model": "poise", "k": 32, "mean": 0.5, "benchmarks": {"AMC23": {"avg_at_k": 0.5}}}
    assert format_table([base, tuned]).splitlines() == [
        "Avg@32",
        "",
        "| Model | AMC23 | AIME24 | Avg |",
        "|---|---:|---:|---:|",
        "| base | 0.422 | 0.078 | 0.250 |",
        "| poise | 0.500 | – | 0.500 |",
    ]


def test_default_benchmarks_are_the_papers_that_have_a_hub_copy():
    assert DEFAULT_BENCHMARKS == tuple(b for b in PAPER_BENCHMARKS if b != "AMC24")


def test_eval_subcommand_runs_and_writes_json(tiny_model_path, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="poise-trl")
    add_eval_parser(parser.add_subparsers(dest="command"))
    output = tmp_path / "out" / "eval.json"
    args = parser.parse_args(
        [
            "eval",
            str(tiny_model_path),
            "--benchmarks",
            f"TINY={BENCH}",
            "--k",
            "2",
            "--max-new-tokens",
            "4",
            "--backend",
            "hf",
            "--limit",
            "2",
            "--output",
            str(output),
        ]
    )
    assert args.func(args) == 0
    written = json.loads(output.read_text())
    assert written["benchmarks"]["TINY"]["num_problems"] == 2
    assert written["benchmarks"]["TINY"]["num_samples"] == 4
    printed = capsys.readouterr().out
    assert "| Model | TINY | Avg |" in printed and str(output) in printed


def test_eval_parser_defaults_are_the_paper_protocol():
    parser = argparse.ArgumentParser()
    add_eval_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", "model"])
    assert (args.k, args.temperature, args.top_p, args.max_new_tokens) == (32, 0.6, 0.95, 8192)
    assert args.benchmarks == list(DEFAULT_BENCHMARKS) and args.backend == "auto"


def test_hf_decoding_stops_at_eos_and_keeps_the_reasoning_marker():
    """TRL-style `skip_special_tokens=True` would drop `</think>` (a special token here) and hide the reasoning."""
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer("ab</think>Answer: 5")["input_ids"] + [tokenizer.eos_token_id, tokenizer.pad_token_id]
    stop = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert _decode_completion(tokenizer, ids, stop) == "ab</think>Answer: 5"
