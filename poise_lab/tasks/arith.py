"""`arith`: arithmetic chat prompts with a verifiable reward, for real instruct models (SmolLM2-135M and up).

"What is 7 + 5? Answer with just the number." The reward is 1 when the first number in the completion equals the
truth, so a sentence around the right number still counts and a wrong first number never does. Prompts come in
families of graded difficulty; the default mix is chosen by measurement on SmolLM2-135M-Instruct (docs: Real model)
so that a large share of prompts have mixed outcomes over 8 samples at the start, and stays hard once the answer
format is learned. Splits are by prompt and deterministic in the seed.
"""

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset

INSTRUCTION = "Answer with just the number."
NUMBER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Family:
    """One kind of question: `draw(rng)` returns its operands and integer answer, `phrasings` the ways to ask it
    (every phrasing names the operands in the order drawn); `operands` bounds its distinct operand tuples."""

    name: str
    description: str
    draw: Callable[[random.Random], tuple[tuple[int, ...], int]]
    phrasings: tuple[str, ...]
    operands: int

    @property
    def size(self) -> int:
        """Distinct prompts of the family."""
        return self.operands * len(self.phrasings)

    def question(self, rng: random.Random) -> tuple[str, int]:
        operands, answer = self.draw(rng)
        return rng.choice(self.phrasings).format(*operands), answer


def _add1(rng: random.Random) -> tuple[tuple[int, ...], int]:
    a, b = rng.randrange(10), rng.randrange(10)
    return (a, b), a + b


def _sub1(rng: random.Random) -> tuple[tuple[int, ...], int]:
    a = rng.randrange(10)
    b = rng.randrange(a + 1)
    return (a, b), a - b


def _max2(rng: random.Random) -> tuple[tuple[int, ...], int]:
    a, b = rng.sample(range(10, 100), 2)
    return (a, b), max(a, b)


def _mul1(rng: random.Random) -> tuple[tuple[int, ...], int]:
    a, b = rng.randrange(2, 10), rng.randrange(2, 10)
    return (a, b), a * b


def _add2(rng: random.Random) -> tuple[tuple[int, ...], int]:
    a, b = rng.randrange(10, 100), rng.randrange(10, 100)
    return (a, b), a + b


def _two_step(rng: random.Random) -> tuple[tuple[int, ...], int]:
    a, b, c = rng.randrange(1, 10), rng.randrange(1, 10), rng.randrange(1, 10)
    return (a, b, c), a + b * c


ADDITION = ("What is {} + {}?", "What is the sum of {} and {}?", "Add {} and {}.")
FAMILIES = {
    f.name: f
    for f in (
        Family("add1", "one-digit addition", _add1, ADDITION, 100),
        Family("sub1", "one-digit subtraction, non-negative result", _sub1,
               ("What is {} - {}?", "What is {} minus {}?", "Compute {} - {}."), 55),
        Family("max2", "the larger of two two-digit numbers", _max2,
               ("Which number is larger, {} or {}?", "Which is bigger: {} or {}?", "What is the larger of {} and {}?"),
               90 * 89),
        Family("mul1", "one-digit multiplication (2-9)", _mul1,
               ("What is {} * {}?", "What is {} times {}?", "What is the product of {} and {}?"), 64),
        Family("add2", "two-digit addition", _add2, ADDITION, 90 * 90),
        Family("two_step", "a + b * c, one digit each", _two_step,
               ("What is {} + {} * {}?", "Compute {} + {} * {}.", "What is {} plus {} times {}?"), 729),
    )
}  # fmt: skip
DEFAULT_FAMILIES = ("add1", "sub1", "max2", "mul1")
# Room for "The answer is 12." and a little more; SmolLM2 answers in 2-10 tokens once it has learned the format.
ARITH_MAX_COMPLETION_LENGTH = 16
ARITH_DATASET = "arith"  # the name that selects this task where the tools take a dataset


def _prompt(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{question} {INSTRUCTION}"}]


def make_arith_splits(
    num_train: int = 2000,
    num_eval: int = 128,
    seed: int = 0,
    families: tuple[str, ...] | list[str] = DEFAULT_FAMILIES,
) -> tuple["Dataset", "Dataset"]:
    """Train and held-out datasets (columns `prompt` (chat messages), `answer`, `family`), deterministic in `seed`.

    Held-out questions are distinct, balanced over families (in the order given) and never appear in train; train
    questions draw a family uniformly and may repeat, as RL prompts do. Held-out prompts may take at most half of a
    family's distinct prompts, or all of them with `num_train=0` (a value benchmark needs no training split).
    """
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise ValueError(f"unknown arith families {unknown}; choose from {', '.join(FAMILIES)}")
    per_family = -(-num_eval // len(families))
    for name in families:
        room = FAMILIES[name].size // 2 if num_train else FAMILIES[name].size
        if per_family > room:
            raise ValueError(
                f"{per_family} held-out {name} prompts would use more than {'half of ' if num_train else ''}its "
                f"{FAMILIES[name].size} distinct ones{', leaving too few for training' if num_train else ''}; lower "
                "num_eval or add families"
            )
    rng = random.Random(seed)
    held_out: dict[str, tuple[str, int, str]] = {}
    for i in range(num_eval):
        family = FAMILIES[families[i % len(families)]]
        question, answer = family.question(rng)
        while question in held_out:
            question, answer = family.question(rng)
        held_out[question] = (question, answer, family.name)
    train: list[tuple[str, int, str]] = []
    while len(train) < num_train:
        family = FAMILIES[rng.choice(families)]
        question, answer = family.question(rng)
        if question not in held_out:
            train.append((question, answer, family.name))
    return _dataset(train), _dataset(list(held_out.values()))


def _dataset(rows: list[tuple[str, int, str]]) -> "Dataset":
    from datasets import Dataset  # here, not at the top: the CLI reads this module's defaults and stays light

    return Dataset.from_dict(
        {
            "prompt": [_prompt(q) for q, _, _ in rows],
            "answer": [str(a) for _, a, _ in rows],
            "family": [f for _, _, f in rows],
        }
    )


def first_number(completion: str | list[dict[str, Any]]) -> str | None:
    """The first integer in the completion's text (conversational completions are joined), else None."""
    if not isinstance(completion, str):
        completion = "".join(str(message["content"]) for message in completion)
    match = NUMBER.search(completion)
    return None if match is None else str(int(match.group()))


def arith_reward(completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """TRL reward: 1.0 when the completion's first number equals the answer, else 0.0."""
    return [float(first_number(c) == a) for c, a in zip(completions, answer, strict=True)]


def training_task(limit: int | None = None) -> tuple["Dataset", Callable[..., list[float]]]:
    """`poise-trl train --dataset_name arith` (entry point `poise_trl.datasets`): the training split, 2000 prompts
    unless `limit`, and its first-number reward."""
    return make_arith_splits(limit or 2000)[0], arith_reward
