"""The library apart from its lab: no `poise_trl` module imports `poise_lab` (read from the source, then checked by
importing every library module in a process where `poise_lab` cannot be imported); the lab reaches the library only
through entry points (`poise_trl/plugins.py`, the lab's side in tests/lab/test_entry_points.py). Inside the library,
imports point one way: the value heads, the features, the pure estimator (none of them importing TRL or
transformers), then the TRL glue, with no circle among its modules (docs/design.md, "Package layout").
"""

import ast
import os
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import poise_trl

LIBRARY = Path(poise_trl.__file__).resolve().parent
ROOT = LIBRARY.parent


def imported_modules(path: Path, root: Path = ROOT, type_checking: bool = True) -> set[str]:
    """Every module the file `path` (under `root`) imports anywhere, top level or inside a function, relative imports
    made absolute, and the constant names it hands to `importlib.import_module` or `__import__`; without
    `type_checking`, not those under `if TYPE_CHECKING:`, which never run."""
    package = ".".join(path.relative_to(root).parent.parts)
    names = set()
    nodes = [ast.parse(path.read_text(), str(path))]
    while nodes:
        node = nodes.pop()
        if not type_checking and isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            nodes.extend(node.orelse)
            continue
        nodes.extend(ast.iter_child_nodes(node))
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


PURE = ("heads", "features", "estimator")
"""The library's pure-torch packages, in order: each imports, of the library, only itself, those before it and the
light settings' modules (`LIGHT`), never the TRL glue (`grpo/`) nor a module above it."""
LIGHT = ("poise_trl.settings", "poise_trl.presets", "poise_trl.choices")
"""The settings' rules, presets and registries' names: no torch, importing none of the packages but the rollout
scalars' table."""
HUGGING_FACE = ("trl", "transformers", "accelerate", "datasets", "huggingface_hub", "peft", "vllm")


def test_the_pure_packages_import_no_trl_and_only_the_packages_below_them():
    offenders = {}
    for i, package in enumerate(PURE):
        allowed = {f"poise_trl.{below}" for below in PURE[: i + 1]} | set(LIGHT)
        for path in sorted((LIBRARY / package).glob("*.py")):
            names = sorted(
                name
                for name in imported_modules(path)
                if name.split(".")[0] in HUGGING_FACE
                or (name.split(".")[0] == "poise_trl" and ".".join(name.split(".")[:2]) not in allowed)
            )
            if names:
                offenders[str(path.relative_to(ROOT))] = names
    assert len(list((LIBRARY / "estimator").glob("*.py"))) > 10 and offenders == {}, offenders


def library_imports(root: Path = LIBRARY) -> dict[str, set[str]]:
    """Each module of the library (dotted, a package by its `__init__`) -> the library modules it imports when it
    runs (`imported_modules` without `TYPE_CHECKING`): a name stands for the longest module it starts with; the
    module's own package, always imported before it, is left out."""
    modules = {
        ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): path
        for path in root.rglob("*.py")
    }

    def module_of(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    arrows = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        names = imported_modules(path, root.parent, type_checking=False)
        arrows[module] = {module_of(name) for name in names} - {None, module, package}
    return arrows


def floors(arrows: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 1 for one that imports no library module, else one above the highest it imports. A
    circle of imports has no floors: it raises."""
    found: dict[str, int] = {}

    def floor(module: str, path: tuple[str, ...]) -> int:
        if module in path:
            raise ValueError(f"modules import each other in a circle: {' -> '.join((*path, module))}")
        if module not in found:
            found[module] = 1 + max((floor(other, (*path, module)) for other in arrows[module]), default=0)
        return found[module]

    for module in arrows:
        floor(module, ())
    return found


def test_no_library_modules_import_each_other_in_a_circle():
    arrows = library_imports()
    assert max(floors(arrows).values()) > 5 and sum(map(len, arrows.values())) > 100
    with pytest.raises(ValueError, match="circle: poise_trl.a -> poise_trl.b -> poise_trl.a"):
        floors({"poise_trl.a": {"poise_trl.b"}, "poise_trl.b": {"poise_trl.a"}})


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
        "if TYPE_CHECKING:\n"
        "    from poise_lab.tasks import toy\n"
    )
    found = {"poise_lab.demo", "poise_lab.bench.gradient", "poise_lab.models.real"}
    assert found | {"poise_lab.tasks.toy"} <= imported_modules(source, tmp_path)
    assert found <= imported_modules(source, tmp_path, type_checking=False)
    assert "poise_lab.tasks.toy" not in imported_modules(source, tmp_path, type_checking=False)
    assert imported_modules(LIBRARY / "cli.py") >= {"poise_trl.plugins", "poise_trl.rlvr.cli.add_train_parser"}


def test_every_third_party_import_of_the_library_is_declared():
    """pyproject.toml declares each distribution a library module imports, among its dependencies or an optional
    engine's extra (not the lab's or the contributors'), rather than relying on what transformers or TRL pull in."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra, requirements in project["optional-dependencies"].items():
        lines += requirements if extra not in ("lab", "dev") else []
    declared = {canonicalize_name(Requirement(line).name) for line in lines}
    imported = {name.split(".")[0] for path in LIBRARY.rglob("*.py") for name in imported_modules(path)}
    third_party = imported - set(sys.stdlib_module_names) - {"poise_trl"}
    distributions = packages_distributions()  # import name -> installed distributions; one not installed: its name
    undeclared = {
        name: sorted(dists)
        for name in third_party
        if not (dists := {canonicalize_name(dist) for dist in distributions.get(name, [name])}) & declared
    }
    assert len(third_party) > 5 and undeclared == {}, undeclared


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )


NO_LAB = "import sys\nfrom tests.without_lab import block_the_lab\nblock_the_lab()\n"


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
