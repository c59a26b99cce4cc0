"""The library apart from its lab: no `poise_trl` module imports `poise_lab` (read from the source, then checked by
importing every library module in a process where `poise_lab` cannot be imported); the lab reaches the library only
through entry points (`poise_trl/plugins.py`), and a lab command without the lab's dependencies says what to install.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import poise_trl
from poise_trl import plugins

LIBRARY = Path(poise_trl.__file__).resolve().parent
ROOT = LIBRARY.parent
INSTALL = 'pip install "poise-trl[lab]"'


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module the file `path` (under `root`) imports anywhere, top level or inside a function, relative imports
    made absolute, and the constant names it hands to `importlib.import_module` or `__import__`."""
    package = ".".join(path.relative_to(root).parent.parts)
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            names.update([module, *(f"{module}.{alias.name}" for alias in node.names)])
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            called = ast.unparse(node.func)
            if called.endswith("import_module") or called == "__import__":
                names.add(str(node.args[0].value))
    return names


def test_no_library_module_imports_the_lab():
    sources = sorted(LIBRARY.rglob("*.py"))
    assert len(sources) > 30 and ROOT / "poise_lab" / "__init__.py" not in sources
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            name for name in imported_modules(path) if name.split(".")[0] == "poise_lab"
        )
        for path in sources
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_import_reader_sees_every_kind_of_import(tmp_path):
    """The check above can fail: each way of importing the lab is found."""
    source = tmp_path / "poise_trl" / "sub" / "mod.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "import poise_lab.demo\n"
        "def f():\n"
        "    from poise_lab.bench import gradient\n"
        "    import importlib\n"
        "    importlib.import_module('poise_lab.models.real')\n"
    )
    assert {"poise_lab.demo", "poise_lab.bench.gradient", "poise_lab.models.real"} <= imported_modules(
        source, tmp_path
    )
    assert imported_modules(LIBRARY / "cli.py") >= {"poise_trl.plugins", "poise_trl.rlvr.cli.add_train_parser"}


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )


NO_LAB = """
import importlib.abc, sys

class NoLab(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "poise_lab":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoLab())
"""


def test_every_library_module_imports_where_the_lab_cannot():
    """Each module of `poise_trl` is imported, the command line built and its own commands parsed, with `poise_lab`
    unimportable; a registered lab command is listed and running it is one error line."""
    done = _run(
        NO_LAB
        + """
import importlib, pkgutil
import poise_trl
from poise_trl import cli

modules = [info.name for info in pkgutil.walk_packages(poise_trl.__path__, "poise_trl.")]
for name in modules:
    importlib.import_module(name)
print(len(modules), sorted(name for name in sys.modules if name.split(".")[0] == "poise_lab"))
cli.parse(["eval", "some/model"]), cli.parse(["train", "--config", "recipe.yaml"])
sys.exit(cli.main(["demo", "--steps", "3"]))
"""
    )
    assert done.returncode == 2, done.stderr
    count, loaded = done.stdout.split(" ", 1)
    assert int(count) > 30 and loaded.strip() == "[]", done.stdout
    assert done.stderr.splitlines() == [
        "poise-trl demo: error: 'demo' comes from poise_lab.demo.cli:add_demo_parser (poise-trl), which cannot be "
        "imported: No module named 'poise_lab'"
    ]


def test_a_lab_command_without_the_labs_dependencies_names_the_extra():
    """With a requirement of the `lab` extra missing (matplotlib, as the installed metadata sees it), every lab
    command and registered name fails in one line that says what to install; the library's own commands still run."""
    done = _run(
        """
import sys
from importlib import metadata

installed = metadata.version
def version(name):
    if name == "matplotlib":
        raise metadata.PackageNotFoundError(name)
    return installed(name)
metadata.version = version

from poise_trl import cli, plugins

for group, name in ((plugins.DATASETS, "arith"), (plugins.MODELS, "smollm2-135m")):
    try:
        plugins.load(plugins.registered(group)[name])
    except ImportError as error:
        print(error)
cli.parse(["eval", "some/model"])
sys.exit(cli.main(["bench", "gradient", "--help"]))
"""
    )
    assert done.returncode == 2, done.stderr
    errors = done.stderr.splitlines()
    assert len(errors) == 1 and errors[0].startswith("poise-trl bench: error: 'bench' comes from "), done.stderr
    for message in (*done.stdout.splitlines(), errors[0]):
        assert message.endswith(f"the poise-trl lab needs matplotlib>=3.8: {INSTALL}"), message
    assert len(done.stdout.splitlines()) == 2


def test_the_lab_registers_its_commands_task_and_model_names():
    from poise_lab.models.real import REAL_MODELS, prepare_real_model
    from poise_lab.tasks.arith import ARITH_DATASET, training_task

    assert set(plugins.registered(plugins.COMMANDS)) == {"demo", "plot", "probe-bench", "bench"}
    assert {name: plugins.load(entry) for name, entry in plugins.registered(plugins.DATASETS).items()} == {
        ARITH_DATASET: training_task
    }
    models = plugins.registered(plugins.MODELS)
    assert set(models) == set(REAL_MODELS) and {plugins.load(entry) for entry in models.values()} == {
        prepare_real_model
    }


class Built(Exception):
    """Raised by the stand-in trainer: what `poise-trl train` would train, without training it."""


def test_train_resolves_a_registered_task_and_model_name(monkeypatch, tmp_path):
    """`poise-trl train --dataset_name arith --model_name_or_path smollm2-135m`: the task's rows and reward, and the
    model folder the lab prepares (stood in for here: the conversion has its own test in tests/demo)."""
    from poise_lab.models import real
    from poise_trl.rlvr import train

    def trainer(**kwargs):
        raise Built(kwargs)

    monkeypatch.setattr(real, "prepare_real_model", lambda name: tmp_path / f"prepared-{name}")
    monkeypatch.setitem(train.TRAINERS, "poise", (trainer, train.TRAINERS["poise"][1]))
    argv = ["--model_name_or_path", "smollm2-135m", "--dataset_name", "arith", "--max_train_samples", "8"]
    argv += ["--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--bf16", "false", "--report_to", "none"]
    with pytest.raises(Built) as built:
        train.main(*train.parse_args(argv))
    kwargs = built.value.args[0]
    assert kwargs["model"] == str(tmp_path / "prepared-smollm2-135m")
    assert kwargs["reward_funcs"].__name__ == "arith_reward" and len(kwargs["train_dataset"]) == 8
