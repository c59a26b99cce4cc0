"""mkdocs hook: the configuration reference is generated from `POISEConfig`'s dataclass fields at build time.

A page marks the spot with `<!-- poise-config-fields -->`; the hook replaces it with one table row per field that
POISE adds or whose default it changes, taking the text from the field's `help` metadata, so the page cannot drift
from the code.
"""

import dataclasses
from typing import Any

MARKER = "<!-- poise-config-fields -->"
PRESETS_MARKER = "<!-- poise-probe-presets -->"


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def config_fields_table() -> str:
    """Markdown table of POISE's own fields (added ones, then those whose default differs from `GRPOConfig`'s)."""
    from trl import GRPOConfig

    from poise_trl import POISEConfig

    parent = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for field in dataclasses.fields(POISEConfig):
        if field.name in parent and _default(parent[field.name]) == _default(field):
            continue
        if not field.init or field.name.startswith("_"):
            continue
        help_text = field.metadata.get("help")
        if not help_text:
            raise ValueError(f"POISEConfig.{field.name} has no `help` metadata: the reference would be empty")
        changed = f" (GRPOConfig: `{_default(parent[field.name])!r}`)" if field.name in parent else ""
        # `list[str]` is an alias whose __name__ is just "list": print generics in full.
        type_name = field.type.__name__ if isinstance(field.type, type) else str(field.type).replace("typing.", "")
        rows.append(f"| `{field.name}` | `{_cell(type_name)}` | `{_default(field)!r}`{changed} | {_cell(help_text)} |")
    return "\n".join(rows)


def presets_table() -> str:
    """Markdown table of the probe presets' ridge penalty and PCA dims."""
    from poise_trl.config import PROBE_PRESETS

    rows = ["| `probe_preset` | `probe_alpha` | `probe_pca_dims` [prompt, reasoning] |", "|---|---|---|"]
    rows += [f"| `{name!r}` | {alpha:g} | {dims} |" for name, (alpha, dims) in PROBE_PRESETS.items()]
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, config_fields_table())
    if PRESETS_MARKER in markdown:
        markdown = markdown.replace(PRESETS_MARKER, presets_table())
    return markdown
