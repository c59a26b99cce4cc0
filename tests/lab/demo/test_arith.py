"""The `arith` task: deterministic disjoint splits balanced over families, and the first-number reward."""

import re

import pytest

from poise_lab.tasks.arith import DEFAULT_FAMILIES, FAMILIES, arith_reward, first_number, make_arith_splits


def test_splits_are_deterministic_disjoint_and_balanced():
    train, held_out = make_arith_splits(num_train=400, num_eval=60, seed=3)
    again_train, again_held_out = make_arith_splits(num_train=400, num_eval=60, seed=3)
    other_train, _ = make_arith_splits(num_train=400, num_eval=60, seed=4)
    assert train.to_dict() == again_train.to_dict() and held_out.to_dict() == again_held_out.to_dict()
    assert train["prompt"] != other_train["prompt"]
    assert set(train.column_names) == {"prompt", "answer", "family"}
    questions = [p[0]["content"] for p in held_out["prompt"]]
    assert len(set(questions)) == 60
    assert not set(questions) & {p[0]["content"] for p in train["prompt"]}
    assert all(held_out["family"].count(f) == 60 // len(DEFAULT_FAMILIES) for f in DEFAULT_FAMILIES)
    assert set(train["family"]) == set(DEFAULT_FAMILIES)


OPERATIONS = {
    "add1": lambda a, b: a + b,
    "add2": lambda a, b: a + b,
    "sub1": lambda a, b: a - b,
    "max2": max,
    "mul1": lambda a, b: a * b,
    "two_step": lambda a, b, c: a + b * c,
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_asks_a_question_whose_answer_is_right_in_every_phrasing(family):
    assert set(OPERATIONS) == set(FAMILIES)
    train, _ = make_arith_splits(num_train=200, num_eval=2, seed=0, families=[family])
    phrasings = set()
    for prompt, answer in zip(train["prompt"], train["answer"], strict=True):
        (message,) = prompt
        assert message["role"] == "user" and message["content"].endswith(" Answer with just the number.")
        operands = [int(n) for n in re.findall(r"\d+", message["content"])]
        assert answer == str(OPERATIONS[family](*operands))
        phrasings.add(re.sub(r"\d+", "{}", message["content"]))
    assert len(phrasings) == len(FAMILIES[family].phrasings)  # every phrasing is used


def test_splits_refuse_more_held_out_prompts_than_a_family_can_spare():
    with pytest.raises(ValueError, match="more than half of its 192 distinct ones.*lower num_eval"):
        make_arith_splits(num_eval=200, families=["mul1", "max2"])
    _, everything = make_arith_splits(num_train=0, num_eval=192, families=["mul1"])  # no training split: all of them
    assert len(set(map(str, everything["prompt"]))) == 192
    with pytest.raises(ValueError, match="more than its 192 distinct ones"):
        make_arith_splits(num_train=0, num_eval=193, families=["mul1"])
    with pytest.raises(ValueError, match="unknown arith families"):
        make_arith_splits(families=["division"])


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("12", "12", 1.0),
        ("The answer is 12.", "12", 1.0),  # a sentence around the right number counts
        ("12 apples, not 13", "12", 1.0),
        ("7 + 5 = 12", "12", 0.0),  # restating the question puts a wrong number first
        ("It is twelve.", "12", 0.0),  # no digits, no reward
        ("012", "12", 1.0),
        ("-3", "3", 0.0),
        ("", "12", 0.0),
        ([{"role": "assistant", "content": "The answer is 52"}], "52", 1.0),  # conversational completion
    ],
)
def test_reward_checks_the_first_number(completion, answer, reward):
    assert arith_reward([completion], [answer]) == [reward]


def test_first_number_is_none_without_digits():
    assert first_number("no digits here") is None
