"""A KeyboardInterrupt at the Nth executed line of `poise_trl`: the line-level interrupt fuzz's tools.

`stop_at(n)` traces the lines of every `poise_trl` source file a block runs (`sys.settrace`) and raises `Stop`, a
KeyboardInterrupt, at the nth; `lines_run` records which (file, line) a block runs, in order, and `first_lines` the
index of each distinct one's first run: stopping there once per distinct line covers every line the block runs.
`same_state` compares two `state_dict()`s exactly (tensors bit for bit), and `forward_hooks` lists the forward hooks
left on a model's modules.
"""

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import poise_trl

LIBRARY = str(Path(poise_trl.__file__).parent)
Line = tuple[str, int]


class Stop(KeyboardInterrupt):
    """The notebook's stop button, pressed at one line."""


@contextmanager
def _tracing(on_line: Callable[[Line], None], files: Callable[[str], bool] | None = None) -> Iterator[None]:
    """Call `on_line` before every line the block runs in a `poise_trl` file (those `files` accepts)."""
    wanted = files or (lambda path: True)

    def local(frame, event, arg):
        if event == "line":
            on_line((frame.f_code.co_filename, frame.f_lineno))
        return local

    def calls(frame, event, arg):
        path = frame.f_code.co_filename
        return local if path.startswith(LIBRARY) and wanted(path) else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(previous)


def lines_run(call: Callable[[], Any], files: Callable[[str], bool] | None = None) -> list[Line]:
    """The (file, line) of every `poise_trl` line `call()` runs, in order."""
    seen: list[Line] = []
    with _tracing(seen.append, files):
        call()
    return seen


def first_lines(seen: list[Line]) -> dict[Line, int]:
    """Each distinct line's 1-based position in `seen` where it runs first."""
    first: dict[Line, int] = {}
    for position, line in enumerate(seen, start=1):
        first.setdefault(line, position)
    return first


@contextmanager
def stop_at(n: int, files: Callable[[str], bool] | None = None) -> Iterator[list[Line]]:
    """Raise `Stop` before the nth `poise_trl` line the block runs (once); the block receives the lines run so far."""
    seen: list[Line] = []

    def count(line: Line) -> None:
        seen.append(line)
        if len(seen) == n:
            raise Stop(f"stopped at {Path(line[0]).name}:{line[1]}")

    with _tracing(count, files):
        yield seen


def where(line: Line) -> str:
    return f"{Path(line[0]).relative_to(LIBRARY)}:{line[1]}"


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two `POISEEstimator.state_dict()`s are equal: the same JSON and the same tensors, bit for bit."""
    if a["info"] != b["info"] or a["tensors"].keys() != b["tensors"].keys():
        return False
    return all(x.dtype == b["tensors"][k].dtype and torch.equal(x, b["tensors"][k]) for k, x in a["tensors"].items())


def forward_hooks(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """(module name, hook) of every forward hook on `model`'s modules."""
    return [(name, hook) for name, module in model.named_modules() for hook in module._forward_hooks.values()]
