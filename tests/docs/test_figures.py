"""Every result figure and verdict of the README, the docs' home, the result pages and the changelog's newest section
is checked against the committed file it comes from: a contradicting edit of a figure (in any form), an interval, a
count, a verdict word, a clause's scope, two runs' swapped figures, a deleted marker or an unmarked verdict fails here,
naming the page, the line and the clause. The marker syntax and the rules are in `tests/docs/figures.py`'s docstring.
"""

import re

import pytest

from . import figures
from .figures import PAGES, ROOT, Clause, check, clauses, header_rows, resolve, theory_lines

CLAUSES = [(page, clause) for page in PAGES for clause in clauses(page)]


def _report(page: figures.Page, clause: Clause) -> list[str]:
    problems = check(clause, header_rows(page), theory_lines(page))
    return [f"{clause.page}:{clause.line}: {clause.shown[:240]!r}\n    " + "\n    ".join(problems)] if problems else []


def test_every_page_cites_its_figures():
    """The markers are in use on every page (a broken comment would silently check nothing)."""
    cited = {clause.page for _, clause in CLAUSES if clause.kind in ("verdict", "figures", "row")}
    assert cited == {page.name for page in PAGES}
    assert sum(clause.kind == "verdict" for _, clause in CLAUSES) >= 100
    assert sum(clause.kind == "row" for _, clause in CLAUSES) >= 100


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_figure_and_verdict_is_its_files(page: figures.Page):
    """Each clause's figures are its sources' at the printed precision and in their order, each verdict is the one
    its file decides, said and not contradicted, over the scope its sources cover; nothing result-like goes
    uncited."""
    bad = [line for p, clause in CLAUSES if p == page for line in _report(p, clause)]
    assert not bad, f"{len(bad)} clause(s) of {page.name} disagree with their files:\n" + "\n".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_markers_leave_the_markdown_intact(page: figures.Page):
    """A marker is invisible only if Markdown reads no syntax in it: none of its lines after the first starts a quote,
    a list item, a heading or a table row, and a marker inside a table row holds no `|` (it would split the cell)."""
    text = page.path.read_text()
    bad = []
    for comment in re.finditer(r"<!--.*?-->", text, re.S):
        line = text.count("\n", 0, comment.start()) + 1
        for number, part in enumerate(comment.group(0).split("\n")[1:], start=line + 1):
            if re.match(r"\s*(?:>|\||[-*+]\s|#+\s|\d+\.\s)", part):
                bad.append(f"{page.name}:{number}: a marker's line starts with Markdown syntax: {part.strip()[:60]!r}")
    for number, row in enumerate(text.splitlines(), start=1):
        if row.startswith("|") and any("|" in c for c in re.findall(r"<!--(.*?)-->", row)):
            bad.append(f"{page.name}:{number}: a marker in a table row holds `|`; select a report's row with `A … B`")
    assert not bad, "\n".join(bad)


def _clause(text: str, kind: str | None = None, cited: str = "", verdict: str | None = None) -> list[str]:
    return check(Clause("x.md", 1, text, kind, verdict, cited))


def test_the_checker_refuses_what_a_reviewer_would_slip_in():
    """The checker itself, on clauses written here: each contradiction of its file fails, the right text passes."""
    share = "real-lm/gradient/{start,start-seed1} poise share_grpo8"
    right = "level with GRPO G=8 (0.97× [0.81, 1.24] and 0.82× [0.71, 1.04] its completions)"
    assert _clause(right, "verdict", share, "level") == []
    assert _clause(right.replace("0.97×", "0.96×"), "verdict", share, "level")  # a figure
    assert _clause(right.replace("[0.81, 1.24]", "[0.81, 1.14]"), "verdict", share, "level")  # an interval
    swapped = "level with GRPO G=8 (0.82× [0.71, 1.04] and 0.97× [0.81, 1.24] its completions)"
    assert any("order" in p for p in _clause(swapped, "verdict", share, "level"))  # two runs swapped
    assert any("decides" in p for p in _clause(right.replace("level", "fewer"), "verdict", share, "fewer"))
    assert any(
        "beside" in p
        for p in _clause(right.replace("level with", "level with, indeed ahead of,"), "verdict", share, "level")
    )
    peers = "efficiency-v3 hops poise vs {grpo8,grpo8_noscale,dapo_ds} auc"
    assert _clause("wins against GRPO G=8 (both) and DAPO-DS on `hops`", "verdict", peers, "wins") == []
    assert any("five" in p for p in _clause("wins against all five comparators on `hops`", "verdict", peers, "wins"))
    assert any(
        "dapo_ds_carry" in p
        for p in _clause("wins against DAPO-DS and DAPO-DS-carry on `hops`", "verdict", peers, "wins")
    )
    assert _clause("it wins on AUC on `hops` (19/20 seeds, p_holm 0.0043)", "verdict", peers, "wins") == []
    assert _clause("it wins on AUC on `hops` (18/20 seeds, p_holm 0.0043)", "verdict", peers, "wins")  # a count
    assert _clause("it wins on AUC on `hops` (19/20 seeds, p_holm 0.0034)", "verdict", peers, "wins")  # a p-value
    # No marker: a result figure, a verdict word of a method.
    assert any("no source" in p for p in _clause("a step costs 1.04× GRPO's at 64 tokens"))
    for said in (
        "POISE outperforms GRPO G=8",
        "POISE needs fewer completions than RLOO",
        "ridge is better than the MLP",
        "the history is always unbiased",
        "POISE is level with GRPO G=8",
    ):
        assert any("without a marker" in p for p in _clause(said)), said
    for setting in ("16 tokens on 2 cores, G = 8, 20 seeds", "`probe_layer` 16 of 30 layers", "α = 0.01, PCA 32/64"):
        assert _clause(setting) == [], setting
    # A marker whose file or path does not exist says so.
    assert any("no committed file" in p for p in _clause("1.01×", "figures", "nowhere/overhead.json > timing"))


def test_a_percentage_a_millisecond_and_a_derived_figure_read_their_files():
    ratio = "real-lm/overhead-zero-pass/overhead.json > timing > 0 > own_pass_time_ratio"
    assert _clause("its own pass costs 19% more", "figures", f"calc [{ratio}] - 1") == []
    assert _clause("its own pass costs 12% more", "figures", f"calc [{ratio}] - 1")
    assert (
        _clause(
            "a refit takes 26 ms",
            "figures",
            "overhead-toy-zero-pass/overhead.json > timing > 0 > poise_probe_fit_seconds_per_step > median",
        )
        == []
    )
    assert resolve("efficiency-v3 sort goal").verdict == "not met"


def test_a_table_marker_names_every_row():
    """A table marker lists one key per body row: a row added under it fails."""
    page = next(p for p in PAGES if p.name == "docs/gradient-quality.md")
    rows = [clause for clause in clauses(page) if clause.kind == "row"]
    assert len(rows) >= 29 and all(clause.cited != "extra row" for clause in rows)


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
