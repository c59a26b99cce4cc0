"""The lab of poise-trl: the demo, the benchmarks, the toy/GGUF models and the toy tasks.

It imports the library (`poise_trl`), never the reverse: the library finds the lab's subcommands, its training task
and its real model names through entry points (`poise_trl.plugins`). The lab's own dependencies are the `lab` extra;
importing the lab without them fails here, in one line that says what to install.
"""

from importlib import metadata

from packaging.requirements import Requirement

INSTALL = 'pip install "poise-trl[lab]"'


def missing_requirements(distribution: str = "poise-trl", extra: str = "lab") -> list[str]:
    """The extra's requirements (as the installed metadata declares them) that are absent or at an excluded version."""
    try:
        declared = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:  # a checkout run without being installed: no metadata to check against
        return []
    missing = []
    for line in declared:
        requirement = Requirement(line)
        if requirement.marker is None or not requirement.marker.evaluate({"extra": extra}):
            continue  # the library's own requirements, or another extra's
        requirement.marker = None
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            missing.append(str(requirement))
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            missing.append(f"{requirement} (found {installed})")
    return missing


if _missing := missing_requirements():
    raise ImportError(f"the poise-trl lab needs {', '.join(_missing)}: {INSTALL}")
