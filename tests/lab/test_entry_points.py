"""The lab as the library finds it: its subcommands, training task and real model names registered as entry points
(`poise_trl/plugins.py`), and, without the lab's dependencies, one line that says what to install."""

import pytest

from poise_trl import plugins

from ..test_library_apart import _run

INSTALL = 'pip install "poise-trl[lab]"'


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
    model folder the lab prepares (stood in for here: the conversion has its own test in tests/lab/demo)."""
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
