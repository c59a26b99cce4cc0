"""The binary math reward on the answer formats reasoning models actually write."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from poise_trl.tasks.math_reward import MAX_ANSWER_CHARS, extract_final_answer, last_boxed, math_answer_reward

# (completion, ground truth, expected reward)
CASES = [
    # fractions: LaTeX, decimal and slash forms are one number
    ("Answer: \\frac{1}{2}", "0.5", 1.0),
    ("Answer: 0.5", "\\frac{1}{2}", 1.0),
    ("Answer: 1/2", "\\frac{1}{2}", 1.0),
    ("Answer: \\dfrac{1}{2}", "1/2", 1.0),
    ("Answer: $\\tfrac34$", "\\frac{3}{4}", 1.0),
    ("Answer: \\frac{1}{3}", "0.5", 0.0),
    # radicals
    ("Answer: 2\\sqrt{2}", "\\sqrt{8}", 1.0),
    ("Answer: \\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}", 1.0),
    ("Answer: \\sqrt{3}", "\\sqrt{2}", 0.0),
    # units, currency, degrees
    ("Answer: 5 cm", "5", 1.0),
    ("Answer: $5\\text{ cm}$", "5", 1.0),
    ("Answer: \\$10", "10", 1.0),
    ("Answer: $10", "10", 1.0),
    ("Answer: 10 dollars", "10", 1.0),
    ("Answer: $10$ dollars", "10", 1.0),
    ("Answer: 30^\\circ", "30", 1.0),
    ("Answer: 30 degrees", "30", 1.0),
    ("Answer: 31^\\circ", "30", 0.0),
    # signs
    ("Answer: -3", "-3", 1.0),
    ("Answer: 3", "-3", 0.0),
    ("Answer: -\\frac{1}{2}", "-0.5", 1.0),
    # integer formatting (AIME answers are stored as "091" or 91.0)
    ("Answer: 91", "091", 1.0),
    ("Answer: 1,000", "1000", 1.0),
    ("Answer: 34.", "34", 1.0),
    # \boxed inside the Answer line, and markdown around it
    ("Answer: \\boxed{42}", "42", 1.0),
    ("Answer: $\\boxed{\\frac{7}{2}}$.", "3.5", 1.0),
    ("**Answer:** 42", "42", 1.0),
    ("**Answer**: 42", "42", 1.0),
    ("The final answer is below.\nAnswer:\n\n  42", "42", 1.0),
    # the LAST Answer line wins
    ("Answer: 1\nWait, I made an error.\nAnswer: 2", "2", 1.0),
    ("Answer: 2\nWait, I made an error.\nAnswer: 1", "2", 0.0),
    # the Answer line wins over a boxed expression elsewhere
    ("so \\boxed{7}\nAnswer: 8", "8", 1.0),
    ("so \\boxed{7}\nAnswer: 8", "7", 0.0),
    # fallback: last \boxed{...}, nested braces included
    ("First \\boxed{1}, then \\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),
    ("First \\boxed{1}, then \\boxed{2}", "1", 0.0),
    # no final answer at all: a number in the text is not an answer
    ("The result is 42", "42", 0.0),
    ("", "42", 0.0),
    ("Answer:", "42", 0.0),
    ("unclosed \\boxed{42", "42", 0.0),
    # reasoning before the last </think> is ignored
    ("Maybe Answer: 7</think>Answer: 8", "8", 1.0),
    ("Maybe Answer: 7</think>Answer: 8", "7", 0.0),
    ("Answer: 7</think>I am not sure.", "7", 0.0),
    ("\\boxed{7}</think>draft</think>Answer: 9", "9", 1.0),
    # text answers fall back to exact matching
    ("Answer: 2x+1", "1+2x", 1.0),
]


@pytest.mark.parametrize("completion, truth, expected", CASES)
def test_reward_table(completion, truth, expected):
    assert math_answer_reward([completion], [truth]) == [expected]


def test_conversational_completions_are_scored_like_strings():
    completions = [
        [{"role": "assistant", "content": "Reasoning.</think>Answer: \\frac{1}{2}"}],
        [{"role": "assistant", "content": "Answer: 3"}],
    ]
    assert math_answer_reward(completions, ["0.5", "4"]) == [1.0, 0.0]


def test_extra_dataset_columns_are_accepted_as_trl_passes_them():
    assert math_answer_reward(["Answer: 2"], ["2"], prompts=["1+1"], problem=["1+1"], trainer_state=None) == [1.0]


def test_unparseable_ground_truth_gives_none_so_trl_skips_the_sample():
    assert math_answer_reward(["Answer: 2", "Answer: 2"], ["", "2"]) == [None, 1.0]


def test_overlong_answers_score_zero():
    assert math_answer_reward(["Answer: " + "1" * (MAX_ANSWER_CHARS + 1)], ["1"]) == [0.0]


def test_works_off_the_main_thread_where_signal_timeouts_are_impossible():
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda c: math_answer_reward([c], ["\\frac{1}{2}"]), ["Answer: 0.5", "Answer: 2"]))
    assert results == [[1.0], [0.0]]


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError):
        math_answer_reward(["Answer: 1", "Answer: 2"], ["1"])


@pytest.mark.parametrize(
    "text, expected",
    [
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{a} and \\fbox{b}", "b"),
        ("\\boxed{{x}+{y}}", "{x}+{y}"),
        ("no box", None),
        ("\\boxed{open", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_extract_final_answer_returns_none_without_an_answer():
    assert extract_final_answer("Let me think. 42 is close.") is None


def test_a_dataset_without_an_answer_column_is_told_to_use_the_loader():
    """open-r1/DAPO-Math-17k-Processed as loaded raw: its final answer is `solution`, which TRL passes by name."""
    with pytest.raises(ValueError, match=r"column named `answer`.*'solution'.*load_math_dataset"):
        math_answer_reward(["Answer: 9"], prompts=["How many divisors does 36 have?"], solution=["9"])
