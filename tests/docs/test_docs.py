"""The README and the docs are tested: every shell command and Python block either runs or is at least parsed.

Blocks are fenced ```bash / ```python in README.md and docs/*.md. A block preceded by an HTML comment
`<!-- requires: gpu, hub, network, long -->` cannot run here (a GPU, the Hugging Face Hub, a package index, or
minutes of CPU; `make test` itself is one), and `<!-- requires: sketch -->` marks an illustration with
placeholders (`...`): such blocks are parsed instead (Python compiled;
shell run with parse-only stand-ins, so `poise-trl` argv goes through the CLI's parser, `poise-trl train` argv (also
under `accelerate launch`, or as examples/train_poise.py) and its YAML recipe through its `TrlParser`, and `make`
targets are looked up). Every other block is executed in a fresh copy of the checkout, with `python` the test's
interpreter and `poise-trl` the CLI of that copy.
"""

import itertools
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```(\w*)\s*$")
REQUIRES = re.compile(r"<!--\s*requires:\s*([\w ,-]+?)\s*-->")
SNIPPET = re.compile(r'^--8<--\s+"([^"]+)"\s*$')
RUNNABLE = {"bash", "python"}


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str
    requires: set[str] = field(default_factory=set)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def expand_snippets(text: str) -> str:
    """pymdownx.snippets' `--8<-- "path"` lines, resolved from the repository root as mkdocs.yml configures it."""
    return "".join(
        (ROOT / m.group(1)).read_text() if (m := SNIPPET.match(line)) else line + "\n" for line in text.splitlines()
    )


def extract_blocks(page: Path) -> list[Block]:
    blocks, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, body = i, []
        i += 1
        while not lines[i].lstrip().startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        previous = next((line for line in reversed(lines[:start]) if line.strip()), "")
        requires = REQUIRES.search(previous)
        needs = {word.strip() for word in requires.group(1).split(",")} if requires else set()
        text = textwrap.dedent("\n".join(body) + "\n")
        blocks.append(Block(page, start + 1, match.group(1), expand_snippets(text), needs))
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in extract_blocks(page)]
CODE_BLOCKS = [block for block in ALL_BLOCKS if block.lang in RUNNABLE]
RUN_BLOCKS = [block for block in CODE_BLOCKS if not block.requires]
# The same text on two pages (README and quickstart share the usage snippets) runs once.
UNIQUE_RUN_BLOCKS = list({block.text: block for block in reversed(RUN_BLOCKS)}.values())[::-1]


def test_pages_have_runnable_blocks_and_every_fence_is_known():
    """The extraction sees the blocks (a broken fence would silently test nothing)."""
    assert {page.name for page in PAGES} >= {"README.md", "index.md", "quickstart.md", "recipes.md", "from-grpo.md"}
    assert len(RUN_BLOCKS) >= 5 and len(CODE_BLOCKS) > len(RUN_BLOCKS)
    unknown = {block.lang for block in ALL_BLOCKS} - RUNNABLE - {"", "text", "bibtex", "yaml", "diff"}
    assert not unknown, f"fenced blocks of an unknown language: {unknown}"
    marks = {need for block in ALL_BLOCKS for need in block.requires}
    assert marks <= {"gpu", "hub", "network", "long", "sketch"}, marks


@pytest.mark.parametrize("block", [b for b in CODE_BLOCKS if b.lang == "python"], ids=lambda b: b.id)
def test_python_blocks_compile(block: Block):
    compile(block.text, block.id, "exec")


def test_diff_blocks_are_one_step_migrations_of_python_scripts():
    """A ```diff block shows a TRL script before and after the switch: both sides compile, the change is the trainer
    class and its import, and the after side is what the CPU variant on the same page runs with POISETrainer."""
    diffs = [block for block in ALL_BLOCKS if block.lang == "diff"]
    assert diffs, "the migration page lost its before/after diff"
    for block in diffs:
        lines = block.text.splitlines()
        before = "\n".join(line[1:] for line in lines if not line.startswith("+"))
        after = "\n".join(line[1:] for line in lines if not line.startswith("-"))
        compile(before, f"{block.id} (before)", "exec")
        compile(after, f"{block.id} (after)", "exec")
        changed = [line for line in lines if line[:1] in "+-" and line[1:].strip()]
        assert len(changed) <= 5, f"{block.id}: {len(changed)} changed lines is not one step"
        assert "GRPOTrainer(" in before and "POISETrainer(" in after and "GRPOConfig(" in after


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A fresh copy of the working tree's tracked and unignored files (what a clone has), no runs, no caches."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    target = tmp_path_factory.mktemp("checkout")
    for name in filter(None, (f.decode() for f in files)):
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    return target


@pytest.fixture(scope="module")
def shell_env(checkout, tmp_path_factory, demo_cache, real_model_path) -> dict[str, str]:
    """`python` is this interpreter and `poise-trl` the checkout's CLI; the model cache holds what `make demo` leaves
    there and the real model's one conversion, as on a machine that ran them: the session's fixtures build both once
    (the same calls the blocks make, from an empty cache), instead of once more here."""
    cache = tmp_path_factory.mktemp("cache")
    shutil.copytree(demo_cache / "poise-trl", cache / "poise-trl")
    # Hard links: the converted model is about 540 MB, and a cached folder is only read.
    shutil.copytree(real_model_path, cache / "poise-trl" / "real" / real_model_path.name, copy_function=os.link)
    bin_dir = tmp_path_factory.mktemp("bin")
    # Wrappers, not symlinks: a symlinked venv interpreter would not find its venv.
    for name, command in (("python", ""), ("poise-trl", " -m poise_trl.cli")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{command} "$@"\n')
        (bin_dir / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(checkout),
        "XDG_CACHE_HOME": str(cache),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }


# Commands that need a GPU, the Hub, a package index or minutes: stand-ins that only record their argv, which the
# test then parses in-process (one import of the parsers for all blocks). `python` gets a stand-in too (below).
STUBBED = ("poise-trl", "accelerate", "make", "trl", "pip")


@pytest.fixture(scope="module")
def parse_env(shell_env, tmp_path_factory) -> dict[str, str]:
    bin_dir = tmp_path_factory.mktemp("stubs")
    record = 'printf "%s\\0" "$@" >> "$DOCS_ARGV_LOG"; printf "\\n" >> "$DOCS_ARGV_LOG"'
    for name in STUBBED:
        (bin_dir / name).write_text(f'#!/bin/sh\nset -- {name} "$@"\n{record}\n')
    # `python -m poise_trl.cli ...` and `python examples/*.py ...` are recorded like `poise-trl` and `accelerate
    # launch`; any other `python` (e.g. `python -c` computing a path) really runs.
    (bin_dir / "python").write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -m ] && [ "$2" = poise_trl.cli ]; then shift 2; set -- poise-trl "$@"; {record}; exit 0; fi\n'
        f'case "$1" in examples/*.py) set -- accelerate launch "$@"; {record}; exit 0;; esac\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    return {**shell_env, "PATH": f"{bin_dir}{os.pathsep}{shell_env['PATH']}"}


def parse_recorded(argv: list[str], checkout: Path) -> None:
    """`poise-trl` by the CLI's parser; `accelerate launch ... SCRIPT ARGS` by the script's own parser (which loads
    the YAML recipe; `--use_cpu true` because bf16 recipes are refused without a GPU); `make` targets looked up."""
    name, args = argv[0], argv[1:]
    if name == "poise-trl":
        parse_poise_trl(args, checkout)
    elif name == "accelerate":
        assert args[0] == "launch", argv
        if "--config_file" in args:
            assert (checkout / args[args.index("--config_file") + 1]).is_file(), argv
        if "-m" in args:  # accelerate launch [...] -m poise_trl.cli train ...
            module = args.index("-m") + 1
            assert args[module] == "poise_trl.cli", argv
            parse_poise_trl(args[module + 1 :], checkout)
            return
        script = next(i for i, word in enumerate(args) if word.endswith(".py"))
        assert (checkout / args[script]).is_file(), argv
        if args[script] == "examples/train_poise.py":  # `poise-trl train` as a script
            parse_poise_trl(["train", *args[script + 1 :]], checkout)
        # another example script: it exists; its own test runs it
    elif name == "make":
        makefile = (checkout / "Makefile").read_text()
        for target in args:
            assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"no make target {target}"
    # `trl` (TRL's own CLI, e.g. `trl vllm-serve`) and `pip` are not ours to parse.


def parse_poise_trl(args: list[str], checkout: Path) -> None:
    """`poise-trl ARGS` by the CLI's parser; `train`'s arguments by its `TrlParser`, which loads the YAML recipe from
    the checkout (`--use_cpu true` because bf16 recipes are refused without a GPU)."""
    from poise_trl.cli import parse
    from poise_trl.rlvr.train import parse_args

    namespace = parse(args)
    if getattr(namespace, "forwards_arguments", False):
        cwd = os.getcwd()
        os.chdir(checkout)
        try:
            parse_args([*namespace.arguments, "--use_cpu", "true"])
        finally:
            os.chdir(cwd)


@pytest.mark.parametrize("block", [b for b in CODE_BLOCKS if b.requires], ids=lambda b: b.id)
def test_marked_blocks_parse(block: Block, checkout: Path, parse_env: dict[str, str], tmp_path):
    """Python is compiled; a shell block is syntax-checked, then run with the stand-ins, so loops and variables
    expand, and every command it would run is parsed."""
    if block.lang == "python":
        compile(block.text, block.id, "exec")
        return
    subprocess.run(["bash", "-n"], input=block.text, text=True, check=True)
    log = tmp_path / "argv.log"
    log.write_text("")
    run = dict(cwd=checkout, env={**parse_env, "DOCS_ARGV_LOG": str(log)}, capture_output=True, text=True)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], **run, timeout=300)
    assert done.returncode == 0, f"{block.id}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    recorded = [line.split("\0")[:-1] for line in log.read_text().splitlines()]
    assert recorded, f"{block.id} runs none of {STUBBED}"
    for argv in recorded:
        parse_recorded(argv, checkout)


@pytest.mark.slow
@pytest.mark.parametrize("block", UNIQUE_RUN_BLOCKS, ids=lambda b: b.id)
def test_documented_blocks_run(block: Block, checkout: Path, shell_env: dict[str, str]):
    shell = ["bash", "-euo", "pipefail", "-c"] if block.lang == "bash" else [sys.executable, "-c"]
    run = dict(cwd=checkout, env=shell_env, capture_output=True, text=True, timeout=600)
    done = subprocess.run([*shell, block.text], **run)
    assert done.returncode == 0, f"{block.id} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    printed = set(re.findall(r"'(poise/[\w/]+)'", done.stdout + done.stderr))  # the trainer's log lines
    assert not [key for key in printed if not documented(key)], f"{block.id} logs keys missing from docs/metrics.md"


METRIC = re.compile(r"poise/[\w/<>ℓ.-]*\w>?")
GLOSSARY = (ROOT / "docs" / "metrics.md").read_text()


def documented(key: str) -> bool:
    """Whether the glossary names `key`; per-domain and per-layer keys match their `<name>`/`<ℓ>` pattern."""
    key = re.sub(r"^eval_", "", key)
    if m := re.fullmatch(r"poise/domain/[^/]+/(\w+)", key):
        return "`poise/domain/<name>/<key>`" in GLOSSARY and (
            f"`poise/{m.group(1)}`" in GLOSSARY or m.group(1) in ("bootstrap", "buffer_size")
        )
    key = re.sub(r"^poise/layer_mae/\d+$", "poise/layer_mae/<ℓ>", key)
    return f"`{key}`" in GLOSSARY


def test_readme_usage_blocks_are_the_snippet_files():
    """The README pastes the snippets (GitHub renders no includes); the docs include the same files."""
    readme = {block.text for block in extract_blocks(ROOT / "README.md") if block.lang == "python"}
    for name in ("usage_gpu.py", "usage_cpu.py"):
        assert (ROOT / "docs" / "snippets" / name).read_text() in readme, f"README's {name} block differs"


def test_readme_fits_a_few_screens_and_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    # The first screen: a few lines on what POISE is, then the two commands, the first code block of the README.
    first = extract_blocks(ROOT / "README.md")[0]
    assert readme.startswith("# poise-trl\n") and first.line <= 12, first.line
    assert first.lang == "bash" and first.requires == {"long"}
    assert first.text.startswith("make demo ") and "\nmake test " in first.text
    for target in re.findall(r"\]\(((?:docs/|CHANGELOG)[^)#]*)", readme):
        assert (ROOT / target).exists(), target
    assert '"trl>=1.16,<1.17"' in (ROOT / "pyproject.toml").read_text() and "trl>=1.16,<1.17" in readme


def _github_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but `-` and `_` dropped, each space a `-`
    (mkdocs' own anchors are checked by `mkdocs build --strict`, `validation.anchors` in mkdocs.yml)."""
    headings = [m.group(1) for m in re.finditer(r"(?m)^#{1,6} (.+)$", page.read_text())]
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_changelog_links_work_on_github_and_on_the_site():
    """The changelog is read on GitHub from the repository root and on the site from `docs/` (docs/hooks.py makes its
    `docs/` links relative there): every link is absolute or names a docs page, and an anchor one of its headings.
    A link into the repository outside `docs/` would break on the site."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    newest = changelog.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]
    links = re.findall(r"\]\(([^)\s]+)\)", changelog)
    assert len(re.findall(r"\]\(docs/", newest)) >= 50, "the newest section links the docs pages with the details"
    for link in links:
        if link.startswith(("https://", "http://")):
            continue
        path, _, anchor = link.partition("#")
        assert path.startswith("docs/") and path.endswith(".md") and (ROOT / path).is_file(), link
        assert not anchor or anchor in _github_anchors(ROOT / path), f"{link}: no such heading on GitHub"


def test_configuration_reference_is_generated_from_every_poise_field():
    import dataclasses

    from trl import GRPOConfig

    from poise_trl import POISEConfig

    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import hooks
    finally:
        sys.path.pop(0)
    table = hooks.config_fields_table()
    own = {f.name for f in dataclasses.fields(POISEConfig)} - {f.name for f in dataclasses.fields(GRPOConfig)}
    assert own and all(f"| `{name}` |" in table for name in own)
    # A changed GRPOConfig default is listed with TRL's value (the type cell is not checked: HfArgumentParser
    # rewrites dataclass field types in place once any test has parsed a POISEConfig).
    assert re.search(r"^\| `num_generations` \| .* \| `2` \(GRPOConfig: `8`\) \| Rollouts per prompt", table, re.M)
    assert "<!-- poise-config-fields -->" in (ROOT / "docs" / "configuration.md").read_text()


def test_every_metric_the_trainer_logs_is_in_the_glossary(tiny_model_path, tmp_path):
    """Train 3 steps with every optional metric family on (auto layer, per-domain probes, prompt selection) and look
    each logged `poise/` key up in docs/metrics.md; also the diagnostics' own keys."""
    from datasets import Dataset

    from poise_trl import POISETrainer
    from poise_trl.estimator.baselines import DIAGNOSTICS
    from tests.conftest import digit_reward, short_args

    assert all(documented(f"poise/{key}") for key in DIAGNOSTICS), DIAGNOSTICS
    dataset = Dataset.from_list(
        [{"prompt": f"{i % 10}{(3 * i) % 10}+{i % 7}", "domain": "ab"[i % 2]} for i in range(32)]
    )
    args = short_args(
        tmp_path,
        max_steps=3,
        probe_layer="auto",
        probe_layer_candidates=[1, 2],
        probe_layer_select_every=1,
        probe_layer_folds=2,
        probe_domain_column="domain",
        prompt_selection="value",
    )
    trainer = POISETrainer(model=str(tiny_model_path), reward_funcs=digit_reward, args=args, train_dataset=dataset)
    trainer.train()
    logged = {key for entry in trainer.state.log_history for key in entry if key.startswith("poise/")}
    assert {"poise/selection/kept_fraction", "poise/domain/a/mae", "poise/layer"} <= logged
    assert any(key.startswith("poise/layer_mae/") for key in logged)
    missing = sorted(key for key in logged if not documented(key))
    assert not missing, f"logged but not in docs/metrics.md: {missing}"


def test_glossary_documents_no_metric_the_code_does_not_name():
    """The reverse direction, statically: every glossary key's last part appears in the package source."""
    source = "".join(path.read_text() for path in (ROOT / "poise_trl").rglob("*.py"))
    for key in set(METRIC.findall(GLOSSARY)):
        last = key.split("/")[-1]
        if last.startswith("<"):  # a placeholder: poise/layer_mae/<ℓ>, poise/domain/<name>/<key>
            continue
        assert re.search(rf"\b{re.escape(last)}\b", source), f"docs/metrics.md names {key}, which the code never logs"


STUDY_REPORT = ROOT / "benchmarks" / "efficiency-v3" / "report.md"


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def _first_table_after(text: str, marker: str) -> list[str]:
    assert marker in text, f"no {marker!r}"
    lines = text.split(marker, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    return list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))


def test_numbers_repeated_across_pages_agree():
    """The performance page quotes every table of the committed study's report, and the README's headline tables are
    that report's POISE (default) rows, task by task: a figure that changes in one place and not the other fails."""
    sections = dict(re.findall(r"(?ms)^## (\w+)\n(.*?)(?=^## |\Z)", STUDY_REPORT.read_text()))
    assert set(sections) == {"sort", "hops"}
    # The performance page includes the report (pymdownx.snippets), so its tables are the report's by construction.
    performance = expand_snippets((ROOT / "docs" / "performance.md").read_text())
    readme = (ROOT / "README.md").read_text()
    for task, section in sections.items():
        missing = [line for line in _table_lines(section) if line not in performance]
        assert not missing, f"docs/performance.md lacks {task} rows of {STUDY_REPORT.name}: {missing[:2]}"
        quoted = _first_table_after(readme, f"**`{task}`**")
        assert quoted[0] in section and quoted[0].startswith("| POISE row | vs |"), quoted[0]
        rows = quoted[2:]
        assert len(rows) == 5 and all(row.startswith("| POISE (default) G=2 |") for row in rows), rows
        assert all(row in section for row in rows), f"README's {task} rows differ from {STUDY_REPORT.name}"


def _number_tokens(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.]*\d)", text.replace(",", "")))


def test_readme_prose_figures_agree_with_the_performance_page():
    """Every figure in the prose of the README's headline (tables and commands aside) is on the performance page;
    the study's time is given with its caveat; and the completions half of the goal names as misses exactly the
    upper ends that lie above their bounds in the committed report. The value heads' paragraph closing the section
    quotes `bench gradient` files: test_figures.py reads its figures from them."""
    readme = (ROOT / "README.md").read_text()
    headline = readme.split("## Headline results", 1)[1].split("\n## ", 1)[0].split("**Value heads", 1)[0]
    prose = "\n".join(line for line in headline.splitlines() if not line.startswith(("|", "![")))
    prose = re.sub(r"(?s)```.*?```", "", prose)
    performance = expand_snippets((ROOT / "docs" / "performance.md").read_text())
    missing = sorted(_number_tokens(prose) - _number_tokens(performance))
    assert not missing, f"README headline figures not on docs/performance.md: {missing}"
    for figure in ("2 h 55 min", "5.2 h", "17.0 s per run"):
        assert figure in prose and figure in performance, figure
    assert "extrapolation" in prose

    report = STUDY_REPORT.read_text()
    goal = re.search(r"at most ([\d.]+)× (.+?)'s and ([\d.]+)× (.+?)'s completions", report)
    bounds = {goal.group(2): float(goal.group(1)), goal.group(4): float(goal.group(3))}
    misses, met = [], []
    for section in re.findall(r"(?ms)^## \w+\n(.*?)(?=^## |\Z)", report):
        for comparator, bound in bounds.items():
            row = next(r for r in _table_lines(section) if r.startswith(f"| POISE (default) G=2 | {comparator} |"))
            upper = float(re.search(r"\[[^,]+, ([\d.]+)\]", row.split("|")[7]).group(1))
            (misses if upper >= bound else met).append(f"{upper:.2f}")
    clause = re.search(r"The completions half misses[^;]*;", " ".join(prose.split()))
    assert clause, "the README no longer says where the completions half of the goal misses"
    assert sorted(re.findall(r"\d\.\d\d", clause.group(0))) == sorted(misses), (clause.group(0), misses)
    assert met and all(f"upper end, {value}, is below its bound" in " ".join(prose.split()) for value in met)


GRPO_CONFIG_OPTIONS_OUTSIDE_ITS_FIELDS = ("use_liger_kernel",)  # a TrainingArguments field GRPOTrainer reads


def test_support_matrix_lists_every_grpo_config_option():
    """Each field GRPOConfig defines, and each TrainingArguments default it changes, has a row with a status
    (tested, configured only, refused); a tested row names its test."""
    import dataclasses

    from transformers import TrainingArguments
    from trl import GRPOConfig

    base = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    options = [
        f.name
        for f in dataclasses.fields(GRPOConfig)
        if f.name not in base or (f.default, f.default_factory) != (base[f.name].default, base[f.name].default_factory)
    ] + list(GRPO_CONFIG_OPTIONS_OUTSIDE_ITS_FIELDS)
    rows = [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in (ROOT / "docs" / "support-matrix.md").read_text().splitlines()
        if line.startswith("| `")
    ]
    for name in options:
        row = next((r for r in rows if re.search(rf"`{name}[`=]", r[0])), None)
        assert row, f"docs/support-matrix.md has no row for GRPOConfig.{name}"
        assert row[1].startswith(("tested", "configured", "refused")), (name, row[1])
        if row[1].startswith("tested"):
            assert re.search(r"test_\w+|\[\w+\]", row[2]), f"{name}: a tested row names its test"
