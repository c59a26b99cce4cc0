"""Committed results are what their records say: every module a recorded command names imports from a fresh clone,
the cheap recorded commands (`bench scalars` on the committed pools, seconds each) rerun exactly as their run.log
writes them give every figure of their committed results.json, and the pools' READMEs list which pools carry
per-token records as the files do."""

import importlib
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from threadpoolctl import threadpool_limits

from poise_trl import cli

ROOT = Path(__file__).resolve().parents[3]
BENCHMARKS = ROOT / "benchmarks"
SCALARS_LOGS = ("gradient-toy-scalars/run.log", "real-lm/scalars/run.log", "preset-costs/run.log")
POOL_READMES = ("gradient-toy-pools/README.md", "real-lm/pools/README.md")
TOLERANCE = 1e-6
"""How far a rerun's figure may be from the committed one: on the machine that measured them they are equal to the
bit; another CPU rounds float32 sums in another order (the example entropy columns: 3.3e-8 at most, see
benchmarks/real-lm/scalars/run.log), far below the 3 decimals results.md prints."""


def recorded_lines(log: Path) -> Iterator[str]:
    """The commands of a run.log: its lines that start with '$ '."""
    for line in log.read_text().splitlines():
        if line.startswith("$ "):
            yield line[2:]


def poise_trl_argv(command: str) -> tuple[dict[str, str], list[str]]:
    """'ENV=VALUE ... poise-trl ARGS  # comment' -> ({ENV: VALUE}, ARGS)."""
    words = shlex.split(command, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words and words[0] == "poise-trl", f"not a poise-trl command: {command}"
    return env, words[1:]


def scalars_commands() -> list[Any]:
    """The recorded `bench scalars` commands, each named by its output folder."""
    commands = [poise_trl_argv(line) for log in SCALARS_LOGS for line in recorded_lines(BENCHMARKS / log)]
    return [
        pytest.param(env, argv, id=argv[argv.index("--output-dir") + 1])
        for env, argv in commands
        if argv[:2] == ["bench", "scalars"]
    ]


def figure_differences(committed: Any, rerun: Any, path: str = "") -> Iterator[str]:
    """Where `rerun` differs from `committed`: a float by more than `TOLERANCE`, anything else at all."""
    if isinstance(committed, dict) and isinstance(rerun, dict):
        if committed.keys() != rerun.keys():
            yield f"{path}: keys {sorted(committed)} != {sorted(rerun)}"
            return
        for key in committed:
            yield from figure_differences(committed[key], rerun[key], f"{path}/{key}")
    elif isinstance(committed, list) and isinstance(rerun, list) and len(committed) == len(rerun):
        for i, (a, b) in enumerate(zip(committed, rerun, strict=True)):
            yield from figure_differences(a, b, f"{path}[{i}]")
    elif isinstance(committed, float) and isinstance(rerun, float):
        if rerun != pytest.approx(committed, rel=TOLERANCE, abs=TOLERANCE):
            yield f"{path}: {committed!r} committed, {rerun!r} rerun"
    elif committed != rerun or type(committed) is not type(rerun):
        yield f"{path}: {committed!r} committed, {rerun!r} rerun"


def test_every_module_a_recorded_command_names_imports():
    """A reward function or a column (MODULE:FUNCTION) in any run.log's command: from the library or the lab, never
    from the tests, which a fresh install does not have."""
    named = {
        match
        for log in BENCHMARKS.rglob("*.log")
        for line in recorded_lines(log)
        for match in re.findall(r"\b([a-z_]+(?:\.[a-z_0-9]+)+):([A-Za-z_]\w*)", line)
    }
    assert ("poise_lab.bench.scalars", "entropy_stats") in named
    for module, attr in sorted(named):
        assert module.split(".")[0] in ("poise_trl", "poise_lab"), f"{module}:{attr} is not the library's or the lab's"
        assert callable(getattr(importlib.import_module(module), attr)), f"{module}:{attr}"


@pytest.mark.parametrize("env, argv", scalars_commands())
def test_bench_scalars_reruns_its_recorded_command_to_every_committed_figure(env, argv, tmp_path, monkeypatch):
    assert set(env) <= {"OMP_NUM_THREADS"}, f"an environment the test does not set: {env}"
    output = argv.index("--output-dir") + 1
    committed = json.loads((ROOT / argv[output] / "results.json").read_text())
    monkeypatch.chdir(ROOT)  # the commands name the pools from the repository's root
    threads = int(env.get("OMP_NUM_THREADS", torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with threadpool_limits(limits=threads):
            assert cli.main([*argv[:output], str(tmp_path), *argv[output + 1 :]]) == 0
    finally:
        torch.set_num_threads(before)
    rerun = json.loads((tmp_path / "results.json").read_text())
    assert committed.keys() == rerun.keys() and "measured" in committed
    del committed["seconds"], rerun["seconds"]
    differences = list(figure_differences(committed, rerun))
    assert not differences, "\n".join(differences)


def readme_token_records(readme: Path) -> dict[str, bool]:
    """A pools README's table: each pool's folder -> whether its row says it carries per-token records."""
    column = None
    rows = {}
    for line in readme.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if "per-token record" in cells:
            column = cells.index("per-token record")
        elif column is not None and line.startswith("| `"):
            assert cells[column] in ("yes", "no"), f"{readme}: {line}"
            rows[cells[0].strip("`")] = cells[column] == "yes"
    return rows


@pytest.mark.parametrize("readme", POOL_READMES)
def test_the_pools_readme_says_which_pools_carry_per_token_records(readme):
    readme = BENCHMARKS / readme
    folders = {path.parent for path in readme.parent.glob("gradient/*/pool.safetensors")}
    listed = readme_token_records(readme)
    assert listed.keys() == {str(folder.relative_to(readme.parent)) for folder in folders}, "one row per pool"
    for folder in folders:
        names = ("pool.tokens.safetensors", "probe_pool.tokens.safetensors")
        carries = [(folder / name).exists() for name in names]
        assert len(set(carries)) == 1, f"{folder}: one of its two per-token records is missing"
        assert listed[str(folder.relative_to(readme.parent))] == carries[0], folder
