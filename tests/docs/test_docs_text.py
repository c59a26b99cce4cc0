"""What the docs' text claims, checked against the code and the committed files: every flag an inline `poise-trl`
command names exists, committed results carry no machine's paths, one figure per fact, no tracker-internal wording."""

import re

import pytest

from .test_docs import PAGES, ROOT

MACHINE_PATH = re.compile(r"(?<![\w.])/(?:root|home|tmp|work|Users)/")


def test_committed_results_name_models_and_relative_paths_not_a_machines_folders():
    """Results files (JSON, markdown) under benchmarks/ name the model and paths relative to their run, not the
    folders of the machine that made them. Raw logs (*.log) are kept as printed. `bench gradient`'s folders are
    written by poise_lab/bench/gradient.py, which still records its collection's path: not checked here yet."""
    files = [
        path
        for path in sorted((ROOT / "benchmarks").rglob("*"))
        if path.suffix in (".json", ".md") and not any(part.startswith("gradient") for part in path.parts)
    ]
    assert len(files) > 10
    found = {str(path.relative_to(ROOT)) for path in files if MACHINE_PATH.search(path.read_text())}
    assert not found, f"absolute machine paths in {sorted(found)}"


INLINE_COMMAND = re.compile(r"`((?:poise-trl|python -m poise_trl\.cli) [^`]+)`")


def _inline_commands() -> list[tuple[str, str]]:
    """(page, command) for every `poise-trl ...` code span in the README and the docs' prose."""
    found = []
    for page in PAGES:
        prose = re.sub(r"(?ms)^\s*```.*?^\s*```", "", page.read_text())  # fenced blocks are parsed above
        found += [(page.name, m.group(1)) for m in INLINE_COMMAND.finditer(prose)]
    return found


@pytest.mark.parametrize("page,command", _inline_commands(), ids=[f"{p}:{c}" for p, c in _inline_commands()])
def test_every_flag_an_inline_command_names_exists(page, command):
    """A `poise-trl SUBCOMMAND --flag ...` span in the prose names a subcommand and flags its parser has (placeholders
    such as MODEL may stand for values); `train`'s flags are looked up in its `TrlParser`."""
    import argparse
    import shlex

    from poise_trl.cli import build_parser
    from poise_trl.rlvr.train import make_parser

    words = shlex.split(command.removeprefix("python -m poise_trl.cli").removeprefix("poise-trl"))
    parser = build_parser()
    while words and not words[0].startswith("-"):
        subparsers = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if subparsers is None or words[0] not in subparsers.choices:
            break  # a positional argument or a placeholder
        parser = subparsers.choices[words.pop(0)]
        if parser.get_default("forwards_arguments"):
            trainer = words[words.index("--trainer") + 1] if "--trainer" in words else "poise"
            parser = make_parser(trainer, "poise-trl train")
            break
    known = {option for action in parser._actions for option in action.option_strings} | {"--config"}
    flags = [word.split("=", 1)[0] for word in words if word.startswith("--")]
    unknown = [flag for flag in flags if flag not in known]
    assert not unknown, f"{page}: `{command}` names {unknown}, which `{parser.prog}` does not have"


def test_pages_speak_to_readers_not_to_the_tracker():
    """No page points at "the issue" (the project's tracker is not the reader's)."""
    for page in PAGES:
        text = page.read_text()
        assert not re.search(r"\bthe issue(?:'s)?\b", text, re.I), f"{page.name} speaks of the issue"


def test_the_demo_time_is_one_figure_everywhere():
    """The tiny demo's duration reads the same on every page that states it and in `poise-trl --help`."""
    from poise_trl.cli import build_parser

    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    assert "shows POISE learning on any laptop, offline, in about a minute on 2 CPU cores" in quickstart
    assert "54 s wall" in quickstart
    assert "(CPU, about a minute)" in " ".join(build_parser().format_help().split())
    vague = re.compile(r"(?:a few seconds|a few minutes|under a minute)")
    for page in PAGES:
        for match in vague.finditer(page.read_text()):
            context = page.read_text()[max(0, match.start() - 200) : match.start()]
            assert not re.search(r"(?:make|poise-trl) demo(?! --model)|tiny model `make demo`", context), (
                f"{page.name}: {match.group(0)!r} for the demo"
            )


GLOSSARY_TERMS = (
    "POISE (paper)",
    "POISE (default)",
    "GRPO G=8 no-scale",
    "VR",
    "Bound",
    "W",
    "M",
    "Bv",
    "Oracle baseline",
    "Oracle sampler",
    "settled prompt",
    "share",
    "avg@k",
    "AUC",
    "wins / undecided / loses",
)


def test_the_results_overview_defines_every_term_the_result_pages_use():
    """The glossary of docs/results.md defines each term in bold where its definition starts, and "bootstrap" in each
    of its three meanings (the baseline before the probe is trusted, the period, the resampling intervals)."""
    page = (ROOT / "docs" / "results.md").read_text()
    glossary = page.split("## Glossary", 1)[1].split("\n## ", 1)[0]
    defined = set(re.findall(r"\*\*([^*]+)\*\*", glossary))
    missing = [term for term in GLOSSARY_TERMS if term not in defined]
    assert not missing, f"docs/results.md's glossary does not define {missing}"
    for meaning in ("the bootstrap baseline", "the bootstrap period", "bootstrap intervals"):
        assert f"**{meaning}**" in glossary, meaning


def test_no_page_points_at_the_tracker_or_the_design_notes_by_number():
    """A reader cannot follow "issue 29" or "section 6 of the design": pages link to the page instead."""
    for page in PAGES:
        text = page.read_text()
        assert not re.search(r"\bissues? \d+|section \d+ of the design", text, re.I), page.name
