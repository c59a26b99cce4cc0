"""`poise_lab` unimportable in this process, as where the library is installed without its lab: `pytest
--without-lab` (the first pytest step of `make test`, the library's tests) and the subprocesses of
`test_library_apart.py` install it before anything imports the lab."""

import importlib.abc
import sys


class WithoutLab(importlib.abc.MetaPathFinder):
    """Refuses `poise_lab` and its submodules before any other finder can find them."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "poise_lab":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def block_the_lab() -> None:
    """Put `WithoutLab` first on `sys.meta_path`; a lab module imported already would still answer, so that is an
    error."""
    loaded = sorted(name for name in sys.modules if name.split(".")[0] == "poise_lab")
    if loaded:
        raise RuntimeError(f"the lab was imported before it could be blocked: {loaded}")
    sys.meta_path.insert(0, WithoutLab())
