"""The README's Usage snippets (docs/snippets/) run as written.

The CPU/offline variant runs as is from a temporary folder, its repository-relative fixture path made absolute and
the demo's model cache set up as `make demo` leaves it. The GPU snippet runs on a GPU with only its data source (a
local file in DAPO-Math-17k-en's schema) and its model (a tiny local one) substituted. On a CPU it cannot run (it
trains in bf16), so it is checked to be the CPU variant's code with only the model, the data source and the
CPU/scale settings changed: the CPU run then covers its every line.
"""

import ast
import json
import math
from pathlib import Path

import pytest
import torch

from poise_trl.tasks.math_data import DAPO_PROMPT_PREFIX, DAPO_PROMPT_SUFFIX

ROOT = Path(__file__).resolve().parents[2]
SNIPPETS = ROOT / "docs" / "snippets"
CPU_FIXTURE = "tests/fixtures/dapo_math_17k_en.jsonl"
# What the CPU variant may add to the GPU snippet's POISEConfig: the CPU settings and a smaller run.
CPU_SETTINGS = {"use_cpu", "bf16", "max_steps", "max_completion_length"}
# The GPU snippet's Qwen3 needs a completion length its reasoning fits in; the CPU variant's tiny model does not.
SCALE_SETTINGS = {"output_dir", "per_device_train_batch_size", "max_completion_length"}


def _substitute(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, f"the snippet must contain {old} exactly once"
    return source.replace(old, new)


def _run(source: str, name: str, cwd: Path, monkeypatch) -> dict:
    monkeypatch.chdir(cwd)
    namespace: dict = {"__name__": "__main__"}
    exec(compile(source, str(SNIPPETS / name), "exec"), namespace)
    return namespace


def _check_trained(trainer, steps: int) -> None:
    assert trainer.state.global_step == steps > 0
    assert trainer.train_dataset.column_names == ["prompt", "answer", "problem"]
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert logged and all(math.isfinite(entry["reward"]) for entry in logged)  # the math reward scored every row
    assert all("poise/mae" in entry and "poise/bootstrap" in entry for entry in logged)


def test_cpu_snippet_runs_as_written(demo_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(demo_cache))
    source = _substitute((SNIPPETS / "usage_cpu.py").read_text(), f'"{CPU_FIXTURE}"', repr(str(ROOT / CPU_FIXTURE)))
    namespace = _run(source, "usage_cpu.py", tmp_path, monkeypatch)
    _check_trained(namespace["trainer"], steps=4)
    assert Path(namespace["model"]).parent == demo_cache / "poise-trl"  # the demo's cached model, not a new one
    assert len(list((demo_cache / "poise-trl").iterdir())) == 1


def _parts(name: str) -> tuple[set[str], dict[str, ast.stmt]]:
    """The snippet's imports (dumped) and its other statements by what they assign (`trainer.train()` by 'train')."""
    tree = ast.parse((SNIPPETS / name).read_text())
    imports = {ast.dump(s) for s in tree.body if isinstance(s, ast.Import | ast.ImportFrom)}
    statements = {}
    for statement in tree.body:
        if isinstance(statement, ast.Assign):
            statements[statement.targets[0].id] = statement
        elif not isinstance(statement, ast.Import | ast.ImportFrom):
            statements[statement.value.func.attr] = statement
    return imports, statements


def test_gpu_snippet_is_the_cpu_variant_at_gpu_scale():
    gpu_imports, gpu = _parts("usage_gpu.py")
    cpu_imports, cpu = _parts("usage_cpu.py")
    assert list(gpu) == list(cpu) == ["dataset", "model", "args", "trainer", "train"]
    assert gpu_imports < cpu_imports
    assert all("poise_lab.models.toy" in extra for extra in cpu_imports - gpu_imports)
    # The same loader on another source; any model; the same trainer and train call.
    for dataset in (gpu["dataset"].value, cpu["dataset"].value):
        assert ast.unparse(dataset.func) == "load_math_dataset" and isinstance(dataset.args[0].value, str)
    assert gpu["dataset"].value.args[0].value == "DAPO-Math-17k-en"
    assert ast.dump(gpu["trainer"]) == ast.dump(cpu["trainer"]) and ast.dump(gpu["train"]) == ast.dump(cpu["train"])
    gpu_config = {kw.arg: ast.dump(kw.value) for kw in gpu["args"].value.keywords}
    cpu_config = {kw.arg: ast.dump(kw.value) for kw in cpu["args"].value.keywords}
    assert ast.unparse(gpu["args"].value.func) == ast.unparse(cpu["args"].value.func) == "POISEConfig"
    assert set(gpu_config) <= set(cpu_config) and set(cpu_config) - set(gpu_config) <= CPU_SETTINGS
    assert {key for key in gpu_config if gpu_config[key] != cpu_config[key]} <= SCALE_SETTINGS


def _write_dapo_en(path: Path, rows: int) -> Path:
    """Rows in open-r1/DAPO-Math-17k-Processed's schema (tests/fixtures/dapo_math_17k_en.jsonl): the problem in
    `prompt`, the final answer in `solution`, the source's other columns alongside."""
    template = json.loads((ROOT / CPU_FIXTURE).read_text().splitlines()[0])
    with path.open("w") as file:
        for i in range(rows):
            problem, answer = f"What is {i} + {i + 1}?", str(2 * i + 1)
            source_prompt = [{"content": DAPO_PROMPT_PREFIX + problem + DAPO_PROMPT_SUFFIX, "role": "user"}]
            row = {**template, "prompt": problem, "solution": answer, "source_prompt": source_prompt}
            row["reward_model"] = {**template["reward_model"], "ground_truth": answer}
            file.write(json.dumps(row) + "\n")
    return path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU snippet trains in bf16, which needs a GPU")
def test_gpu_snippet_runs_with_a_local_file_and_a_tiny_model(tiny_model_path, tmp_path, monkeypatch):
    source = (SNIPPETS / "usage_gpu.py").read_text()
    source = _substitute(source, '"DAPO-Math-17k-en"', repr(str(_write_dapo_en(tmp_path / "dapo_en.jsonl", rows=8))))
    source = _substitute(source, '"Qwen/Qwen3-4B"', repr(str(tiny_model_path)))
    trainer = _run(source, "usage_gpu.py", tmp_path, monkeypatch)["trainer"]
    _check_trained(trainer, steps=trainer.state.max_steps)
