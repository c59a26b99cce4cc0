"""A batch's domains: how the name a row carries (its domain column's value, e.g. a data source) becomes its domain
(`ROUTINGS`, which `BufferSpec.routing` names), and the refusal of a prompt whose rollouts fall in two domains. No
torch.

The reference routing is the POISE authors' (verl-project/verl-recipe, `poise/probe.py`, `domain_for`): a training
set mixing many data sources gets three probes, math, code and other, each with its own buffer.
"""

from collections.abc import Callable, Sequence

MATH_SOURCES = frozenset({"openai/gsm8k", "lighteval/math", "huggingfaceh4/math-500"})
"""Data sources the reference routes to "math" besides those whose name starts with "math"."""

CODE_SOURCES = frozenset({"codecontests", "apps", "codeforces", "taco"})
"""Data sources the reference routes to "code" besides those whose name starts with "codegen"."""


def reference_domain(source: str) -> str:
    """The reference's domain of a data source: "math", "code" or "other" (the name lower-cased, without surrounding
    spaces)."""
    name = str(source).strip().lower()
    if name.startswith("math") or name in MATH_SOURCES:
        return "math"
    if name.startswith("codegen") or name in CODE_SOURCES:
        return "code"
    return "other"


ROUTINGS: dict[str, Callable[[str], str]] = {"identity": str, "reference": reference_domain}
"""`probe_domain_routing` -> a row's domain from the name it carries. A new routing is one entry: any function of the
name alone (a row's domain must not depend on the batch it arrives in)."""


def routed(names: Sequence[str] | None, routing: str) -> list[str] | None:
    """Each row's domain from the `names` its rows carry (None: rows carry none)."""
    return None if names is None else [ROUTINGS[routing](name) for name in names]


def check_same_domain(domains: Sequence[str], num_generations: int) -> None:
    """Refuse a prompt whose rollouts (a group of `num_generations` consecutive rows) fall in two domains: its rows
    would be learned by two probes and its baseline read from another domain's."""
    for start in range(0, len(domains), num_generations):
        group = list(domains[start : start + num_generations])
        if len(set(group)) > 1:
            raise ValueError(
                f"The rollouts of one prompt (rows {start}-{start + num_generations - 1}) fall in the domains "
                f"{group}, but same_domain_groups (probe_same_domain_groups) keeps a prompt's rollouts in one "
                "domain: give every rollout of a prompt the same domain, or turn the setting off."
            )
