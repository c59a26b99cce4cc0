"""Math datasets in one shape: a conversational `prompt` with the DAPO template (paper App. C.4) and a string `answer`.

Every training set and benchmark of the paper is mapped onto the columns `prompt`, `answer` and `problem`, whether
it comes from the Hugging Face Hub or from a local JSONL/parquet file with the Hub columns. The same template is
used for training and evaluation, as in the paper.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset

# DAPO's template, verbatim (paper App. C.4). BytedTsinghua-SIA/DAPO-Math-17k stores its prompts with it applied.
DAPO_PROMPT_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_PROMPT_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

# Column names tried, in order, when a source does not say which columns hold the problem and the answer.
# `answer` precedes `solution` because AIME24 has both and its `solution` is a worked solution, while in the
# open-r1 DAPO set `solution` is the final answer and there is no `answer` column.
PROBLEM_COLUMNS = ("problem", "question", "prompt")
ANSWER_COLUMNS = ("answer", "solution", "reward_model.ground_truth")


@dataclass(frozen=True)
class BenchmarkSpec:
    """Where a dataset lives on the Hub and which (dotted) columns hold the problem text and the final answer."""

    hub_id: str | None
    split: str
    problem: str
    answer: str
    config: str | None = None
    note: str = ""


# Schemas as published on the Hub (dataset cards / viewer; see the module tests' fixtures for one row of each).
BENCHMARKS: dict[str, BenchmarkSpec] = {
    # 1.79M rows (17k unique problems repeated ~100x); `prompt` is a one-message list with the template applied.
    "DAPO-Math-17k": BenchmarkSpec("BytedTsinghua-SIA/DAPO-Math-17k", "train", "prompt", "reward_model.ground_truth"),
    # The paper's training set: deduplicated, Chinese prompts removed (14,116 rows); `solution` is the final answer.
    "DAPO-Math-17k-en": BenchmarkSpec("open-r1/DAPO-Math-17k-Processed", "train", "prompt", "solution", config="en"),
    "AMC23": BenchmarkSpec("math-ai/amc23", "test", "question", "answer"),
    "AMC24": BenchmarkSpec(
        None,
        "train",
        "problem",
        "answer",
        note="no verified Hub copy of the paper's 40 AMC 2024 problems is known; pass a local JSONL/parquet file "
        "with `problem` and `answer` columns, e.g. `AMC24=path/to/amc24.jsonl` on the command line",
    ),
    "AIME24": BenchmarkSpec("HuggingFaceH4/aime_2024", "train", "problem", "answer"),
    "AIME25": BenchmarkSpec("MathArena/aime_2025", "train", "problem", "answer"),
    "AIME26": BenchmarkSpec("MathArena/aime_2026", "train", "problem", "answer"),
    "HMMT25": BenchmarkSpec("MathArena/hmmt_feb_2025", "train", "problem", "answer"),
    "BRUMO25": BenchmarkSpec("MathArena/brumo_2025", "train", "problem", "answer"),
}

# Paper Table 1 column order.
PAPER_BENCHMARKS = ("AMC23", "AMC24", "AIME24", "AIME25", "AIME26", "HMMT25", "BRUMO25")

# Benchmarks that `poise-trl eval` runs by default: the paper's, except those without a known Hub copy.
DEFAULT_BENCHMARKS = tuple(name for name in PAPER_BENCHMARKS if BENCHMARKS[name].hub_id is not None)
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def dapo_prompt(problem: str) -> list[dict[str, str]]:
    """The paper's single-turn prompt in TRL's conversational format."""
    return [{"role": "user", "content": DAPO_PROMPT_PREFIX + problem + DAPO_PROMPT_SUFFIX}]


def strip_dapo_template(text: str) -> str:
    """The bare problem of an already-templated prompt, so the template is never applied twice."""
    if text.startswith(DAPO_PROMPT_PREFIX):
        text = text[len(DAPO_PROMPT_PREFIX) :]
    if text.endswith(DAPO_PROMPT_SUFFIX):
        text = text[: -len(DAPO_PROMPT_SUFFIX)]
    return text


def answer_to_str(value: Any) -> str:
    """Ground truths come as strings, ints or floats (`34.0`); the verifier wants the plain string `34`."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value).strip()


def _problem_text(value: Any) -> str:
    """A problem stored as text or as a chat (DAPO's one-message `prompt` list), without the DAPO template."""
    if isinstance(value, list):
        value = next(message["content"] for message in value if message["role"] == "user")
    return strip_dapo_template(str(value).strip())


def _lookup(row: dict[str, Any], column: str) -> Any:
    """`row["a"]["b"]` for the dotted column `a.b`: DAPO keeps its ground truth in `reward_model.ground_truth`."""
    value: Any = row
    for key in column.split("."):
        value = value[key]
    return value


def _has_column(dataset: "Dataset", column: str) -> bool:
    head, _, rest = column.partition(".")
    if head not in dataset.column_names:
        return False
    return not rest or rest in dataset.features[head]


def _pick_column(dataset: "Dataset", candidates: tuple[str, ...], kind: str) -> str:
    for column in candidates:
        if _has_column(dataset, column):
            return column
    raise ValueError(f"no {kind} column among {list(candidates)}; the dataset has {dataset.column_names}")


def to_prompt_answer(
    dataset: "Dataset", problem_column: str | None = None, answer_column: str | None = None
) -> "Dataset":
    """Map any supported schema to `prompt` (DAPO template, conversational), `answer` (str) and `problem` (str)."""
    problem_column = problem_column or _pick_column(dataset, PROBLEM_COLUMNS, "problem")
    answer_column = answer_column or _pick_column(dataset, ANSWER_COLUMNS, "answer")

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        problem = _problem_text(_lookup(row, problem_column))
        answer = answer_to_str(_lookup(row, answer_column))
        return {"prompt": dapo_prompt(problem), "answer": answer, "problem": problem}

    from datasets import Features, List, Value  # here, not at the top: `poise-trl --help` reads this registry

    # Drop the source columns: `prompt` may change type (str -> chat), and rows must have one schema.
    # Declared, not inferred: `map` would otherwise cast a new `answer` back to the source column's int/float type.
    features = Features(
        {
            "prompt": List({"role": Value("string"), "content": Value("string")}),
            "answer": Value("string"),
            "problem": Value("string"),
        }
    )
    return dataset.map(convert, remove_columns=dataset.column_names, features=features)


def resolve_benchmark(name_or_path: str) -> tuple[str, str]:
    """Split `NAME=PATH` into a display name and a source; a bare registry key, Hub id or path names itself."""
    name, sep, source = name_or_path.partition("=")
    if sep:
        return name, source
    path = Path(name_or_path)
    if path.suffix in LOCAL_FORMATS:
        return path.stem, name_or_path
    return name_or_path, name_or_path


def benchmark_spec(name: str) -> BenchmarkSpec | None:
    """The registry entry for `name` (case-insensitive), or None."""
    return next((spec for key, spec in BENCHMARKS.items() if key.lower() == name.lower()), None)


def dataset_hub_id(name_or_path: str) -> str | None:
    """The Hub id a model card should link to: a registry key's id, a Hub id itself, None for a local file."""
    spec = benchmark_spec(name_or_path)
    if spec is not None:
        return spec.hub_id
    return None if Path(name_or_path).suffix in LOCAL_FORMATS else name_or_path


def _load_from_hub(hub_id: str, config: str | None, split: str) -> "Dataset":
    """`datasets.load_dataset`, with what to do instead when the Hub cannot be reached (offline, no network)."""
    from datasets import load_dataset

    try:
        return load_dataset(hub_id, config, split=split)
    except ConnectionError as error:
        raise ConnectionError(
            f"{error}. Offline, pass a local .jsonl/.json/.parquet file with the same columns instead of {hub_id!r}"
        ) from error


def load_math_dataset(
    name_or_path: str,
    split: str | None = None,
    config: str | None = None,
    problem_column: str | None = None,
    answer_column: str | None = None,
    limit: int | None = None,
) -> "Dataset":
    """Load a registered benchmark, any Hub dataset id, or a local `.jsonl`/`.json`/`.parquet` file.

    Registry keys (`BENCHMARKS`, case-insensitive) bring their own split, config and columns. Other Hub ids use
    `split` (default "train"); local files are read whole. Both detect the columns from `PROBLEM_COLUMNS` and
    `ANSWER_COLUMNS` unless given. `limit` keeps the first rows only, for smoke runs.
    """
    spec = benchmark_spec(name_or_path)
    path = Path(name_or_path)
    if spec is not None:
        if spec.hub_id is None:
            raise ValueError(f"{name_or_path}: {spec.note}")
        dataset = _load_from_hub(spec.hub_id, config or spec.config, split or spec.split)
        problem_column = problem_column or spec.problem
        answer_column = answer_column or spec.answer
    elif path.suffix in LOCAL_FORMATS:
        if not path.is_file():
            raise FileNotFoundError(f"no dataset file at {path}")
        from datasets import load_dataset

        dataset = load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
    else:
        dataset = _load_from_hub(name_or_path, config, split or "train")
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    return to_prompt_answer(dataset, problem_column, answer_column)
