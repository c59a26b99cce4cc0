"""The entry-point groups through which another package adds to poise-trl, and how an entry is loaded.

The library imports no such package: it reads what installed distributions declare (pyproject's
`[project.entry-points."GROUP"]`) and imports an entry only where it is used. This repository's lab, `poise_lab`,
adds its subcommands, a training task and real model names this way.

- `poise_trl.commands`: NAME = `add_NAME_parser(subparsers)`, the subcommand `poise-trl NAME` (cli.py's rules).
- `poise_trl.datasets`: NAME = `f(limit)` returning (training dataset, reward function), for `poise-trl train
  --dataset_name NAME`; `limit` is `--max_train_samples` (None: the task's own size).
- `poise_trl.named_models`: NAME = `f(NAME)` returning a local model folder, for `poise-trl train
  --model_name_or_path NAME`.
"""

from importlib.metadata import EntryPoint, entry_points
from typing import Any

COMMANDS = "poise_trl.commands"
DATASETS = "poise_trl.datasets"
MODELS = "poise_trl.named_models"


def registered(group: str) -> dict[str, EntryPoint]:
    """The group's entries by name, in the order the installed distributions declare them."""
    return {entry.name: entry for entry in entry_points(group=group)}


def load(entry: EntryPoint) -> Any:
    """The entry's object; where its package (or a dependency of it) cannot be imported, an ImportError that says
    which entry it was and keeps the package's own message (the lab's names the extra to install)."""
    try:
        return entry.load()
    except ImportError as error:
        source = f"{entry.value} ({entry.dist.name})" if entry.dist else entry.value
        raise ImportError(f"{entry.name!r} comes from {source}, which cannot be imported: {error}") from error
