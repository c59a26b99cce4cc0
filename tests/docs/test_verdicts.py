"""Every verdict the README, the results overview and the settings guide state cites the committed file that decides
it, and this test decides it again from that file.

A clause that states a verdict ends with an HTML comment, which GitHub and the docs site do not show:

    ... is level with ridge (+0.02 W [−0.01, +0.05]) <!-- verdict level: real-lm/gradient/trained-history-seed1
    poise_head_ensemble - poise -->

naming a result folder under `benchmarks/` and what in it the clause summarizes; `{a,b}` stands for each
alternative and `;` separates sources. Every source must give the marker's verdict, by the rule of its kind:

- `FOLDER TASK ROW vs REF auc` (or `target`): the pair in `FOLDER/efficiency.json` (`bench efficiency`): wins, loses
  or undecided, by the glossary's rule (a Holm-corrected p below 0.05 decides, the median's side says who; a
  to-target median of "never" loses);
- `FOLDER TASK goal`: the study's goal there, met or not met;
- `FOLDER A - B`: a paired difference in `FOLDER/results.json` (`bench gradient`, lora subspace): lower, higher or
  level (its 95% interval below 0, above it, or across it);
- `FOLDER ROW share_REF`: a row's share of REF's completions there (the per-prefix rows included): fewer, more or
  level (its interval below 1, above it, or across it).

The clause (the text since the previous marker, within one paragraph or table row) must say the verdict in words,
and each figure it prints as `X [L, U]`, `p_holm P` or `N/M` must be one of its sources' at the printed precision.
A clause that says a verdict without a marker fails as well, so a new verdict cannot go uncited.
"""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .test_docs import ROOT

ALPHA = 0.05  # the glossary's threshold on p_holm
MARKER = re.compile(r"<!--\s*verdict ([a-z ]+?):\s*(.+?)\s*-->")
# How the prose may word each verdict. A clause must contain one wording of its marker's verdict.
WORDING = {
    "wins": r"\bwins?\b|\bbeats?\b",
    "loses": r"\bloses?\b|\blost\b",
    "undecided": r"\bundecided\b",
    "met": r"(?<!not )\bmet\b",
    "not met": r"\bnot met\b",
    "lower": r"\blower\b|\bbelow\b|\bcuts?\b|\bless\b|\bbetter\b|\bhelps?\b",
    "higher": r"\bhigher\b|\babove\b|\b(?:pays?|costs?) more\b|\bworse\b|\bdearer\b",
    "level": r"\blevel\b",
    "fewer": r"\bfewer\b|\bless\b|\bahead\b|\bbelow\b|\bhelps?\b",
    "more": r"\bmore\b|\bbehind\b|\babove\b",
}
# Words that state a verdict: a clause holding one needs a marker.
VERDICT_WORDS = re.compile(
    r"\b(?:wins?|loses?|beats?|undecided|level|behind|ahead of|helps?|helped|(?:pays?|costs?) more|dearer)\b", re.I
)
INTERVAL = re.compile(r"([+−-]?\d+(?:\.\d+)?)(?:×| W)? \[([+−-]?\d+(?:\.\d+)?), ([+−-]?\d+(?:\.\d+)?)\]")
P_HOLM = re.compile(r"p_holm (\d+(?:\.\d+)?(?:e-\d+)?)")
COUNT = re.compile(r"(?<![\w./])(\d+)/(\d+)(?![\w./])")


@dataclass(frozen=True)
class Page:
    path: Path
    skip_tables: bool = False  # the README's tables are the reports' own rows, checked where they are copied
    skip_sections: tuple[str, ...] = ()  # e.g. a glossary, which defines the verdict words rather than using them


PAGES = (
    Page(ROOT / "README.md", skip_tables=True),
    Page(ROOT / "docs" / "results.md", skip_sections=("## Glossary",)),
    Page(ROOT / "docs" / "choosing-settings.md"),
)


@dataclass
class Decided:
    """What one source decides, and the figures a clause may print from it."""

    source: str
    verdict: str
    intervals: list[tuple[float, ...]] = field(default_factory=list)
    p_values: list[float] = field(default_factory=list)
    counts: list[str] = field(default_factory=list)


def expand(text: str) -> list[str]:
    """`a{b,c}d` -> ["abd", "acd"]; several groups expand independently."""
    group = re.search(r"\{([^{}]*)\}", text)
    if not group:
        return [text]
    head, tail = text[: group.start()], text[group.end() :]
    return [out for alt in group.group(1).split(",") for out in expand(head + alt + tail)]


def sources(cited: str) -> list[str]:
    return [one for part in cited.split(";") for one in expand(part.strip())]


EFFICIENCY = re.compile(r"(\S+) (\w+) (\w+) vs (\w+) (auc|target)")
GOAL = re.compile(r"(\S+) (\w+) goal")
PAIRED = re.compile(r"(\S+) (\w+ - \w+)")
SHARE = re.compile(r"(\S+) (\w+) (share_\w+)")


def _read(folder: str, name: str, source: str) -> dict:
    path = ROOT / "benchmarks" / folder / name
    assert path.is_file(), f"{source}: no committed file {path.relative_to(ROOT)}"
    return json.loads(path.read_text())


def _efficiency(source: str, pair: dict, metric: str) -> Decided:
    median, low, high = pair["auc_gain_diff"] if metric == "auc" else pair["completions_to_target_ratio"]
    p = pair["p_holm"] if metric == "auc" else pair["p_holm_target"]
    if median is None:  # a to-target median of "never": the reference reached the target, this row did not
        verdict = "loses"
    elif p is None or p >= ALPHA:
        verdict = "undecided"
    else:
        verdict = "wins" if (median > 0 if metric == "auc" else median < 1) else "loses"
    won = pair["wins"] if metric == "auc" else pair["target_wins"]
    intervals = [(median, low, high)] if None not in (median, low, high) else []
    return Decided(source, verdict, intervals, [p] if p is not None else [], [f"{won}/{pair['seeds']}"])


def decide(source: str) -> Decided:
    """The verdict of one source, recomputed from its committed file."""
    if match := EFFICIENCY.fullmatch(source):
        folder, task, row, ref, metric = match.groups()
        contenders = _read(folder, "efficiency.json", source)["tasks"][task]["contenders"]
        assert ref in contenders.get(row, {}).get("paired", {}), f"{source}: {row} is not paired with {ref} on {task}"
        return _efficiency(source, contenders[row]["paired"][ref], metric)
    if match := GOAL.fullmatch(source):
        folder, task = match.groups()
        met = _read(folder, "efficiency.json", source)["tasks"][task]["goal"]["met"]
        return Decided(source, "met" if met else "not met")
    if match := PAIRED.fullmatch(source):
        folder, pair = match.groups()
        paired = _read(folder, "results.json", source)["subspaces"]["lora"]["paired"]
        assert pair in paired, f"{source}: no paired difference {pair!r} (there: {sorted(paired)})"
        entry = paired[pair]
        below, above, reference = "lower", "higher", 0.0
    elif match := SHARE.fullmatch(source):
        folder, row, share = match.groups()
        results = _read(folder, "results.json", source)
        prefix_rows = results.get("prefix", {}).get("subspaces", {}).get("lora", {}).get("table", {})
        tables = [results["subspaces"]["lora"]["table"], prefix_rows]
        entry = next((table[row][share] for table in tables if share in table.get(row, {})), None)
        assert entry, f"{source}: no row {row!r} with {share!r}"
        below, above, reference = "fewer", "more", 1.0
    else:
        kinds = "FOLDER TASK ROW vs REF auc|target, FOLDER TASK goal, FOLDER A - B, FOLDER ROW share_REF"
        raise AssertionError(f"{source!r} is none of: {kinds}")
    value, (low, high) = entry["value"], entry["ci"]
    verdict = below if high < reference else above if low > reference else "level"
    return Decided(source, verdict, [(value, low, high)])


def _number(printed: str) -> float:
    return float(printed.replace("−", "-"))


def agrees(printed: str, value: float) -> bool:
    """`printed` is `value` at its printed decimals."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(_number(printed) - value) <= 0.5 * 10**-decimals + 1e-12


def agrees_p(printed: str, p: float) -> bool:
    """`printed` is `p` at its printed significant digits (0.00018, 8.4e-05, 1)."""
    digits = max(len(re.sub(r"e.*", "", printed).replace(".", "").lstrip("0")), 1)
    return float(f"{p:.{digits}g}") == float(printed)


@dataclass
class Clause:
    page: str
    line: int
    text: str
    verdict: str | None = None  # None: the text after a unit's last marker, which cites nothing
    cited: str = ""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}:{self.verdict or 'uncited'}"


def units(page: Page) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph, heading and table row, outside fenced code and skipped sections."""
    found, block, start, fenced, skipped = [], [], 0, False, None  # skipped: the level of the section skipped
    for number, line in enumerate(page.path.read_text().splitlines() + [""], start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        heading = re.match(r"#+ ", line) if not fenced else None
        if heading and skipped and len(heading.group(0)) - 1 <= skipped:
            skipped = None
        if heading and line.startswith(page.skip_sections or "\0"):
            skipped = len(heading.group(0)) - 1
        if fenced or skipped:
            continue
        if line.startswith("|") or heading:
            if block:
                found.append((start, " ".join(block)))
                block = []
            if not (page.skip_tables and line.startswith("|")):
                found.append((number, line))
        elif line.strip():
            if not block:
                start = number
            block.append(line.strip())
        elif block:
            found.append((start, " ".join(block)))
            block = []
    return found


def clauses(page: Page) -> list[Clause]:
    """A paragraph's or a table cell's text cut at each marker: each piece before a marker is that marker's clause,
    the piece after the last one cites nothing."""
    out = []
    for line, unit in units(page):
        for text in unit.strip("|").split("|") if unit.startswith("|") else [unit]:
            rest = 0
            for marker in MARKER.finditer(text):
                out.append(Clause(page.path.name, line, text[rest : marker.start()], marker.group(1), marker.group(2)))
                rest = marker.end()
            out.append(Clause(page.path.name, line, text[rest:]))
    return out


def check(clause: Clause) -> list[str]:
    """What is wrong with one clause: a verdict its file does not give or its prose does not say, a figure none of
    its sources holds; or, for a clause with no marker, a verdict said without a source."""
    text = " ".join(clause.text.split())
    if clause.verdict is None:
        said = VERDICT_WORDS.search(text)
        return [f"says {said.group(0)!r} and cites no file (end it with <!-- verdict ...: SOURCE -->)"] if said else []
    assert clause.verdict in WORDING, f"{clause.id}: unknown verdict {clause.verdict!r}; one of {sorted(WORDING)}"
    decided = [decide(source) for source in sources(clause.cited)]
    problems = [
        f"{d.source} decides {d.verdict!r}, not {clause.verdict!r}" for d in decided if d.verdict != clause.verdict
    ]
    if not re.search(WORDING[clause.verdict], text, re.I):
        problems.append(f"the clause does not say {clause.verdict!r} (any of {WORDING[clause.verdict]})")
    intervals = [i for d in decided for i in d.intervals]
    for match in INTERVAL.finditer(text):
        if not any(all(agrees(p, v) for p, v in zip(match.groups(), i, strict=True)) for i in intervals):
            problems.append(f"{match.group(0)!r} is none of the cited figures {_shown(intervals)}")
    p_values = [p for d in decided for p in d.p_values]
    for match in P_HOLM.finditer(text):
        if not any(agrees_p(match.group(1), p) for p in p_values):
            problems.append(f"{match.group(0)!r} is none of the cited p_holm {[f'{p:.2g}' for p in p_values]}")
    counts = [c for d in decided for c in d.counts]
    for match in COUNT.finditer(text):
        if match.group(0) not in counts:
            problems.append(f"{match.group(0)!r} is none of the cited seed counts {counts}")
    return problems


def _shown(intervals: list[tuple[float, ...]]) -> list[str]:
    return [f"{v:+.3f} [{lo:+.3f}, {hi:+.3f}]" for v, lo, hi in intervals]


CITED = [clause for page in PAGES for clause in clauses(page) if clause.verdict]


def test_the_pages_cite_their_verdicts():
    """The marker syntax is in use on every page (a broken comment would silently check nothing)."""
    assert {clause.page for clause in CITED} == {page.path.name for page in PAGES}
    assert len(CITED) >= 20


@pytest.mark.parametrize("clause", CITED, ids=lambda c: c.id)
def test_each_verdict_is_the_one_its_file_gives(clause: Clause):
    problems = check(clause)
    assert not problems, f"{clause.id}: {' '.join(clause.text.split())!r}\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.path.name)
def test_no_verdict_goes_uncited(page: Page):
    uncited = [(clause, check(clause)) for clause in clauses(page) if not clause.verdict]
    bad = [
        f"{c.page}:{c.line}: {problems[0]}: {' '.join(c.text.split())[:160]!r}" for c, problems in uncited if problems
    ]
    assert not bad, "\n".join(bad)


def test_the_check_refuses_a_verdict_its_file_does_not_give():
    """The checker itself: C-GRPO on `hops` is undecided against POISE (default) in the committed study, so a
    sentence saying it loses fails, and so do a figure and a p-value that are not the file's."""
    source = "efficiency-peers hops cgrpo vs poise auc"
    assert decide(source).verdict == "undecided"
    right = Clause("x", 1, "C-GRPO is undecided on `hops` (4/20 seeds, p_holm 0.05)", "undecided", source)
    assert check(right) == []
    wrong_verdict = Clause("x", 1, "C-GRPO loses on `hops`", "loses", source)
    assert any("decides 'undecided'" in problem for problem in check(wrong_verdict))
    unsaid = Clause("x", 1, "C-GRPO on `hops`", "undecided", source)
    assert any("does not say" in problem for problem in check(unsaid))
    wrong_figures = Clause("x", 1, "undecided: −0.018 [−0.021, −0.012], p_holm 0.04, 5/20", "undecided", source)
    assert len(check(wrong_figures)) == 3
    assert check(Clause("x", 1, "C-GRPO loses on `hops`")) != []  # a verdict with no marker


def _peer_rows(text: str, task: str) -> dict[str, list[str]]:
    section = re.search(rf"(?ms)^## {task}\n(.*?)(?=^## |\Z)", text).group(1)
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in section.splitlines() if line.startswith("|")]
    return {row[0]: row[2:] for row in rows if len(row) > 2 and row[1] == "POISE (default) G=2"}


def test_the_readmes_peer_rows_are_the_reports():
    """The README's table of the peers against POISE (default) is the study report's rows, cell for cell."""
    report = (ROOT / "benchmarks" / "efficiency-peers" / "report.md").read_text()
    readme = (ROOT / "README.md").read_text()
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in readme.splitlines() if line.startswith("| `")]
    peers = [row for row in rows if len(row) == 9 and row[0].strip("`") in ("sort", "hops")]
    assert len(peers) == 6, peers
    for task, peer, *cells in peers:
        expected = _peer_rows(report, task.strip("`")).get(peer)
        assert expected, f"README names {peer} on {task}, which the report does not pair with POISE (default)"
        assert [cell.replace("−", "-") for cell in cells] == expected, (task, peer)
