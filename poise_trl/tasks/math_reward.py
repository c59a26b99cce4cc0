"""The paper's binary math reward: 1 if the final answer of a completion equals the ground truth, else 0.

The same function scores training rollouts and evaluation samples (paper App. C.4). The final answer is the last
`Answer:` line after the reasoning (the DAPO template asks for it), else the last `\\boxed{...}`; math-verify then
decides equality, so `\\frac{1}{2}`, `0.5` and `1/2` all match.
"""

import logging
import re
import threading
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

REASONING_END = "</think>"
# `Answer:`, also written `**Answer:**` or `**Answer**:` in markdown.
_ANSWER_RE = re.compile(r"answer[\s*]*:", re.IGNORECASE)
# Currency words are not in math-verify's unit list; its list covers the rest (cm, degrees, units, ...).
_CURRENCY_RE = re.compile(r"\s*(?:\\text\{\s*)?(?:dollars?|usd)\s*\}?\s*$", re.IGNORECASE)
# Longer "answers" are not final answers, and parsing them without a timeout (in threads) could hang.
MAX_ANSWER_CHARS = 512
# Boxed first, then any LaTeX, then plain expressions such as `1/2`.
_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
_PARSE_TIMEOUT_S = 5
_VERIFY_TIMEOUT_S = 5


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """The text of a TRL completion, given either as a string or as a list of chat messages."""
    if isinstance(completion, str):
        return completion
    return "\n".join(str(message["content"]) for message in completion)


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces included; None if absent/unclosed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    open_brace = text.find("{", start)
    if open_brace < 0:
        return None
    depth = 0
    for i in range(open_brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_brace + 1 : i].strip()
    return None


def extract_final_answer(text: str) -> str | None:
    """The answer a completion commits to: its last `Answer:` line after the reasoning, else its last `\\boxed{}`.

    Anything before the last `</think>` is reasoning and ignored, so an answer tried while thinking never counts.
    """
    text = text.rsplit(REASONING_END, 1)[-1]
    matches = list(_ANSWER_RE.finditer(text))
    if matches:
        lines = text[matches[-1].end() :].split("\n")
        # "Answer:" alone on its line is followed by the answer on the next non-empty line.
        answer = next((line.strip(" \t*") for line in lines if line.strip(" \t*")), "")
        boxed = last_boxed(answer)
        return boxed if boxed is not None else answer or None
    return last_boxed(text)


def _as_latex(answer: str) -> str:
    """Wrap a bare answer in `$...$` so math-verify reads it as LaTeX; drop `$` signs, currency and a final period."""
    answer = answer.replace("\\$", "").replace("$", "").strip()
    answer = _CURRENCY_RE.sub("", answer).strip().rstrip(".").strip()
    return f"${answer}$"


def _timeouts() -> tuple[int | None, int | None]:
    """math-verify's timeouts use SIGALRM, which raises off the main thread: there, run without them."""
    if threading.current_thread() is threading.main_thread():
        return _PARSE_TIMEOUT_S, _VERIFY_TIMEOUT_S
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)  # the "timeout is disabled" warning is expected here
    return None, None


def is_correct(answer: str | None, ground_truth: str) -> bool | None:
    """Whether an extracted answer equals the ground truth; None when the ground truth itself cannot be parsed."""
    parse_timeout, verify_timeout = _timeouts()
    gold = parse(_as_latex(ground_truth), extraction_config=_EXTRACTION, parsing_timeout=parse_timeout)
    if not gold:
        return None
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return False
    predicted = parse(_as_latex(answer), extraction_config=_EXTRACTION, parsing_timeout=parse_timeout)
    return bool(predicted) and verify(gold, predicted, timeout_seconds=verify_timeout)


def math_answer_reward(
    completions: list[str] | list[list[dict[str, Any]]], answer: list[str] | None = None, **kwargs: Any
) -> list[float | None]:
    """TRL reward function: 1.0 for a correct final answer, 0.0 otherwise, None if the ground truth is unparseable.

    `answer` is the dataset column of ground truths (see `poise_trl.tasks.math_data`); TRL passes it by name. None
    makes TRL skip the sample (NaN) instead of teaching the policy from a broken label. A dataset without an `answer`
    column fails with what to do, instead of Python's bare missing-argument error.
    """
    if answer is None:
        raise ValueError(
            "math_answer_reward needs the ground truths in a dataset column named `answer`; it was given "
            f"{sorted(kwargs)}. Load the dataset with poise_trl.tasks.math_data.load_math_dataset, which maps the Hub "
            "schemas (DAPO-Math-17k's `solution`, `reward_model.ground_truth`, ...) to `answer` and applies the "
            "DAPO prompt template."
        )
    rewards: list[float | None] = []
    for completion, truth in zip(completions, answer, strict=True):
        correct = is_correct(extract_final_answer(completion_text(completion)), str(truth))
        rewards.append(None if correct is None else float(correct))
    return rewards
