"""Dataset loaders: every schema of the paper's data maps to a DAPO-templated chat prompt and a string answer."""

from pathlib import Path

import datasets
import pytest
from datasets import Dataset, load_dataset

from poise_trl.tasks.math_data import (
    BENCHMARKS,
    DAPO_PROMPT_PREFIX,
    DAPO_PROMPT_SUFFIX,
    PAPER_BENCHMARKS,
    answer_to_str,
    dapo_prompt,
    dataset_hub_id,
    load_math_dataset,
    resolve_benchmark,
    strip_dapo_template,
)

FIXTURES = Path(__file__).parents[1] / "fixtures"

# Paper App. C.4, typed out independently of the module so that a drift in the constant is caught.
PAPER_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def test_dapo_prompt_is_the_paper_template_as_one_user_message():
    assert dapo_prompt("What is 1+1?") == [{"role": "user", "content": PAPER_TEMPLATE.format(problem="What is 1+1?")}]


def test_strip_dapo_template_recovers_the_problem_and_leaves_bare_problems_alone():
    problem = "Find $x$ if $2x = 6$."
    assert strip_dapo_template(dapo_prompt(problem)[0]["content"]) == problem
    assert strip_dapo_template(problem) == problem


@pytest.mark.parametrize(
    "value, expected", [(34.0, "34"), (7, "7"), (" 091 ", "091"), ("\\frac{1}{2}", "\\frac{1}{2}"), (0.5, "0.5")]
)
def test_answer_to_str(value, expected):
    assert answer_to_str(value) == expected


@pytest.mark.parametrize(
    "fixture, problems, answers",
    [
        (
            "dapo_math_17k.jsonl",
            ["What is $3 \\times 4 + 22$?", "If $\\frac{a}{b} = \\frac{3}{7}$ in lowest terms, find $a + b$."],
            ["34", "10"],
        ),
        (
            # One `prompt` is bare and one already carries the template: both must end up templated exactly once.
            "dapo_math_17k_en.jsonl",
            ["How many positive divisors does $36$ have?", "Find the remainder when $2^{10}$ is divided by $7$."],
            ["9", "2"],
        ),
        (
            # `answer` must win over `solution`, which here is a worked solution.
            "aime_2024.jsonl",
            [
                "Find the number of ordered pairs $(a,b)$ of positive integers with $a+b=10$.",
                "What is the largest two-digit multiple of $13$?",
            ],
            ["9", "091"],
        ),
        (
            "amc23.jsonl",
            [
                "A rectangle has sides $3$ and $4$. What is the length of its diagonal?",
                "What is $\\frac{1}{2} + \\frac{1}{4}$ written as $\\frac{m}{n}$ in lowest terms? Give $m+n$.",
            ],
            ["5", "7"],
        ),
        (
            "matharena.jsonl",
            ["Compute $1 + 2 + \\cdots + 10$.", "How many subsets does a $4$-element set have?"],
            ["55", "16"],
        ),
    ],
)
def test_local_files_with_hub_columns_map_to_prompt_and_answer(fixture, problems, answers):
    dataset = load_math_dataset(str(FIXTURES / fixture))
    assert dataset.column_names == ["prompt", "answer", "problem"]
    assert dataset["problem"] == problems
    assert dataset["answer"] == answers
    assert dataset["prompt"] == [dapo_prompt(p) for p in problems]
    for prompt in dataset["prompt"]:
        assert prompt[0]["content"].count(DAPO_PROMPT_PREFIX) == 1
        assert prompt[0]["content"].count(DAPO_PROMPT_SUFFIX) == 1


def test_parquet_files_load_like_jsonl(tmp_path):
    path = tmp_path / "aime.parquet"
    load_dataset("json", data_files=str(FIXTURES / "aime_2024.jsonl"), split="train").to_parquet(str(path))
    assert load_math_dataset(str(path))["answer"] == ["9", "091"]


def test_explicit_columns_override_detection_and_limit_keeps_the_first_rows():
    dataset = load_math_dataset(
        str(FIXTURES / "dapo_math_17k_en.jsonl"), answer_column="reward_model.ground_truth", limit=1
    )
    assert dataset["answer"] == ["9"]
    assert len(dataset) == 1


def test_missing_columns_are_named_in_the_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "1+1", "answer": "2"}\n')
    with pytest.raises(ValueError, match="no problem column"):
        load_math_dataset(str(path))


def test_missing_local_file_raises():
    with pytest.raises(FileNotFoundError):
        load_math_dataset("does/not/exist.jsonl")


# Each registry entry is checked against a fixture with its Hub columns; the Hub call itself is intercepted.
REGISTRY_FIXTURES = {
    "DAPO-Math-17k": "dapo_math_17k.jsonl",
    "DAPO-Math-17k-en": "dapo_math_17k_en.jsonl",
    "AMC23": "amc23.jsonl",
    "AIME24": "aime_2024.jsonl",
    "AIME25": "matharena.jsonl",
    "AIME26": "matharena.jsonl",
    "HMMT25": "matharena.jsonl",
    "BRUMO25": "matharena.jsonl",
}


@pytest.mark.parametrize("name", sorted(REGISTRY_FIXTURES))
def test_registry_names_load_their_hub_dataset_with_the_registered_split_config_and_columns(monkeypatch, name):
    calls = []
    rows = load_dataset("json", data_files=str(FIXTURES / REGISTRY_FIXTURES[name]), split="train")

    def fake_load_dataset(path, config=None, split=None):
        calls.append((path, config, split))
        return rows

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    spec = BENCHMARKS[name]
    dataset = load_math_dataset(name.lower())  # registry names are case-insensitive
    assert calls == [(spec.hub_id, spec.config, spec.split)]
    assert dataset.column_names == ["prompt", "answer", "problem"]
    assert all(isinstance(a, str) and a for a in dataset["answer"])


def test_the_paper_training_set_is_the_english_dedup_config():
    spec = BENCHMARKS["DAPO-Math-17k-en"]
    assert (spec.hub_id, spec.config, spec.split) == ("open-r1/DAPO-Math-17k-Processed", "en", "train")


def test_every_paper_benchmark_is_registered():
    assert set(PAPER_BENCHMARKS) <= set(BENCHMARKS)


def test_amc24_without_a_hub_copy_asks_for_a_local_file():
    with pytest.raises(ValueError, match="local JSONL/parquet"):
        load_math_dataset("AMC24")


def test_other_hub_ids_are_passed_through_with_default_split(monkeypatch):
    calls = []
    rows = Dataset.from_list([{"problem": "1+1", "answer": 2}])
    monkeypatch.setattr(datasets, "load_dataset", lambda path, config=None, split=None: calls.append(split) or rows)
    assert load_math_dataset("someone/math-set")["answer"] == ["2"]
    assert calls == ["train"]


def test_resolve_benchmark_names_local_files_by_stem_and_accepts_name_equals_path():
    assert resolve_benchmark("AIME24") == ("AIME24", "AIME24")
    assert resolve_benchmark("data/amc24.jsonl") == ("amc24", "data/amc24.jsonl")
    assert resolve_benchmark("AMC24=data/amc24.jsonl") == ("AMC24", "data/amc24.jsonl")


def test_dataset_hub_id_links_registry_keys_and_hub_ids_but_not_local_files():
    assert dataset_hub_id("aime24") == "HuggingFaceH4/aime_2024"
    assert dataset_hub_id("someone/math-set") == "someone/math-set"
    assert dataset_hub_id("data/train.jsonl") is None


def test_an_unreachable_hub_says_to_pass_a_local_file_instead(monkeypatch):
    def offline(path, config=None, split=None):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConnectionError, match=r"HuggingFaceH4/aime_2024.*Offline, pass a local \.jsonl"):
        load_math_dataset("AIME24")
