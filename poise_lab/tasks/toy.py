"""Synthetic verifiable tasks for the tiny model whose prompts differ in difficulty: `sort` and `hops`.

`sort`: sort k digits.

Prompt `"31513="`, target completion `"5</think>11335"` then EOS: a one-token "reasoning" span (how many digits
will be written), the `</think>` marker, then the answer. The reward is 1 when the text after the last `</think>`
is exactly the sorted digits. Sorting is learned in about a hundred supervised steps, but every extra digit is one
more chance to slip, so per-prompt success falls with k (after the default warm start: 0.65 at k=2, 0.06 at k=8,
0.33 overall). The value probe therefore has a real signal to learn, from the prompt (k, repeated digits) and from the
reasoning span (a miscounted length predicts a wrong answer). `max(a, b)` is learned too uniformly and
`(a + b) mod 10` not at all in minutes (DESIGN §4).

`hops`: pointer chasing. The prompt `2:7152903846=` holds a hop count h (0-3) and ten digits d0..d9; start at
x0 = d0, hop x_{i+1} = d[x_i], and answer x_h x_{h+1} (two digits), after a one-token reasoning span x0. Every prompt
has 13 characters and every completion 4 tokens plus EOS, so difficulty is invisible in prompt and completion
length: it comes from the content (h hops to compose). After 200 warm-up steps a tiny model gets h=0 mostly right
and h=3 mostly wrong, so many G=8 groups tie at both ends.
"""

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset

REASONING_END = "</think>"
PROMPT_SUFFIX = "="
DEFAULT_DIFFICULTIES = (2, 8)
# Longest completion: one count digit, the marker, 8 digits and EOS is 11 tokens.
MAX_COMPLETION_LENGTH = 12
DEMO_WARMUP_STEPS = 100
DEMO_WARMUP_LR = 1e-3
HOPS_DIGITS = 10
HOPS_MAX = 3
TASKS = ("sort", "hops")


def sorted_digits(digits: str) -> str:
    return "".join(sorted(digits))


def target_completion(answer: str, reasoning: str | None = None) -> str:
    """The supervised completion (EOS excluded): the reasoning token (default: the digit count, as in `sort`), the
    reasoning-end marker, the sorted digits."""
    return f"{len(answer) if reasoning is None else reasoning}{REASONING_END}{answer}"


def _sample_digits(rng: random.Random, k: int) -> str:
    return "".join(str(rng.randrange(10)) for _ in range(k))


def make_sort_splits(
    num_train: int = 2000,
    num_eval: int = 140,
    min_digits: int = DEFAULT_DIFFICULTIES[0],
    max_digits: int = DEFAULT_DIFFICULTIES[1],
    seed: int = 0,
) -> tuple["Dataset", "Dataset"]:
    """Train and held-out datasets (columns `prompt`, `answer`, `k`), deterministic in `seed`.

    Held-out prompts are distinct, balanced over k and never appear in train, so held-out avg@k measures
    generalisation rather than memorised prompts. Train prompts draw k uniformly and may repeat, as RL prompts do.
    """
    if not 1 <= min_digits <= max_digits <= 9:
        raise ValueError(f"difficulty range [{min_digits}, {max_digits}] must lie within [1, 9] digits")
    ks = list(range(min_digits, max_digits + 1))
    per_k = -(-num_eval // len(ks))
    if per_k > 10**min_digits // 2:
        raise ValueError(
            f"{per_k} held-out prompts with {min_digits} digits would use more than half of the {10**min_digits} "
            "possible ones; lower num_eval or raise min_digits"
        )
    rng = random.Random(seed)
    held_out: list[str] = []
    for i in range(num_eval):
        k = ks[i % len(ks)]
        digits = _sample_digits(rng, k)
        while digits in held_out:
            digits = _sample_digits(rng, k)
        held_out.append(digits)
    excluded = set(held_out)
    train: list[str] = []
    while len(train) < num_train:
        digits = _sample_digits(rng, rng.choice(ks))
        if digits not in excluded:
            train.append(digits)
    return _to_dataset(train), _to_dataset(held_out)


def _to_dataset(digit_strings: list[str]) -> "Dataset":
    return _dataset(digit_strings, [len(d) for d in digit_strings], [str(len(d)) for d in digit_strings])


def _dataset(digit_strings: list[str], difficulty: list[int], reasoning: list[str]) -> "Dataset":
    from datasets import Dataset  # here, not at the top: the CLI reads this module's defaults and stays light

    return Dataset.from_dict(
        {
            "prompt": [d + PROMPT_SUFFIX for d in digit_strings],
            "answer": [sorted_digits(d) for d in digit_strings],
            "k": difficulty,
            "reasoning": reasoning,
        }
    )


def hop_chain(digits: str, hops: int) -> list[int]:
    """x0 = d0, x_{i+1} = d[x_i]: the positions visited, x0 .. x_{hops+1}."""
    chain = [int(digits[0])]
    for _ in range(hops + 1):
        chain.append(int(digits[chain[-1]]))
    return chain


def _hops_dataset(rows: list[tuple[int, str]]) -> "Dataset":
    from datasets import Dataset

    chains = [hop_chain(digits, h) for h, digits in rows]
    return Dataset.from_dict(
        {
            "prompt": [f"{h}:{digits}{PROMPT_SUFFIX}" for h, digits in rows],
            "answer": [f"{chain[-2]}{chain[-1]}" for chain in chains],
            "k": [h for h, _ in rows],
            "reasoning": [str(chain[0]) for chain in chains],
        }
    )


def make_hops_splits(num_train: int = 2000, num_eval: int = 140, seed: int = 0) -> tuple["Dataset", "Dataset"]:
    """Train and held-out `hops` datasets (columns `prompt`, `answer`, `k` = hops, `reasoning`).

    As for `sort`: deterministic in `seed`, held-out prompts distinct, balanced over h and never in train.
    """
    rng = random.Random(seed)
    held_out: list[tuple[int, str]] = []
    while len(held_out) < num_eval:
        row = (len(held_out) % (HOPS_MAX + 1), _sample_digits(rng, HOPS_DIGITS))
        if row not in held_out:
            held_out.append(row)
    excluded = set(held_out)
    train: list[tuple[int, str]] = []
    while len(train) < num_train:
        row = (rng.randrange(HOPS_MAX + 1), _sample_digits(rng, HOPS_DIGITS))
        if row not in excluded:
            train.append(row)
    return _hops_dataset(train), _hops_dataset(held_out)


def make_splits(
    task: str,
    num_train: int = 2000,
    num_eval: int = 140,
    seed: int = 0,
    min_digits: int = DEFAULT_DIFFICULTIES[0],
    max_digits: int = DEFAULT_DIFFICULTIES[1],
) -> tuple["Dataset", "Dataset"]:
    """The splits of `task` ("sort" uses the digit range; "hops" has one length and ignores it)."""
    if task == "sort":
        return make_sort_splits(num_train, num_eval, min_digits, max_digits, seed=seed)
    if task == "hops":
        return make_hops_splits(num_train, num_eval, seed=seed)
    raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")


def extract_answer(completion: str | list[dict[str, Any]]) -> str | None:
    """The text after the last `</think>`, stripped; None without a marker (an unfinished or malformed answer)."""
    if not isinstance(completion, str):  # conversational: a list of messages
        completion = "".join(str(message["content"]) for message in completion)
    if REASONING_END not in completion:
        return None
    return completion.rsplit(REASONING_END, 1)[1].strip()


def task_reward(completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """TRL reward: 1.0 when the final answer equals the sorted digits, else 0.0 (binary, as in the paper)."""
    return [float(extract_answer(c) == a) for c, a in zip(completions, answer, strict=True)]
