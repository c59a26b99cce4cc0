"""mkdocs hooks: tables generated from the code, MathJax served by the site, and TRL's docstring conventions rendered.

- A page marks the spot with `<!-- poise-config-fields -->`; the hook replaces it with one table row per field that
  POISE adds or whose default it changes, taking the text from the field's `help` metadata, so the page cannot drift
  from the code. The API page gets the same fields as `POISEConfig`'s parameters (`TRLDocstrings`). The probe presets
  (`<!-- poise-probe-presets -->`), the rollout scalars (`<!-- poise-rollout-scalars -->`) and the TRL contract
  (`<!-- poise-trl-contract -->`, poise_trl/grpo/contract.py) come from their tables the same way.
- The changelog page includes `CHANGELOG.md`, whose links name the docs pages as GitHub finds them from the
  repository root (`docs/PAGE.md#anchor`); the hook includes it with those links made relative to the page, so one
  file's links work on GitHub and on the site, where `mkdocs build --strict` checks each page and anchor.
- MathJax's es5 bundle, its fonts and its TeX extensions are copied from the installed `django-static-mathjax`
  package (MathJax 3.2, Apache-2.0) into the site at build time, so the math renders offline and the repository
  carries no copy.
- `TRLDocstrings` is a Griffe extension for mkdocstrings: docstrings follow TRL's doc-builder conventions
  (``[`POISETrainer`]``, ``[`~trl.GRPOConfig`]``), which it turns into links, and it puts the blank line Markdown
  needs before a list that follows a paragraph. It also shows a `default_factory` field's default as its value.
"""

import dataclasses
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import griffe
from mkdocs.structure.files import File

MARKER = "<!-- poise-config-fields -->"
PRESETS_MARKER = "<!-- poise-probe-presets -->"
SCALARS_MARKER = "<!-- poise-rollout-scalars -->"
CONTRACT_MARKER = "<!-- poise-trl-contract -->"
CHANGELOG_INCLUDE = '--8<-- "CHANGELOG.md"'
MATHJAX_DIR = "assets/mathjax"  # where the site serves MathJax; mkdocs.yml's extra_javascript names the bundle in it
MATHJAX_FILES = ("tex-mml-chtml.js", "output/chtml/fonts/woff-v2/*.woff", "input/tex/extensions/*.js")
TRL_DOCS = "https://huggingface.co/docs/trl"
TRL_PAGES = {"GRPOConfig": "grpo_trainer", "GRPOTrainer": "grpo_trainer"}  # TRL names our docstrings reference


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _cell(text: str) -> str:
    """One table cell: one line, `|` escaped outside code spans (inside them Python-Markdown keeps it literal)."""
    return re.sub(r"(`[^`]*`)|\|", lambda m: m.group(1) or "\\|", " ".join(str(text).split()))


def poise_fields() -> Iterator[tuple[str, str, str, str]]:
    """(name, type, default, help) of POISE's own fields, then of those whose default differs from `GRPOConfig`'s
    (the default with TRL's in brackets)."""
    from trl import GRPOConfig

    from poise_trl import POISEConfig

    parent = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    for field in dataclasses.fields(POISEConfig):
        if field.name in parent and _default(parent[field.name]) == _default(field):
            continue
        if not field.init or field.name.startswith("_"):
            continue
        help_text = field.metadata.get("help")
        if not help_text:
            raise ValueError(f"POISEConfig.{field.name} has no `help` metadata: the reference would be empty")
        default = f"`{_default(field)!r}`"
        if field.name in parent:
            default += f" (GRPOConfig: `{_default(parent[field.name])!r}`)"
        # `list[str]` is an alias whose __name__ is just "list": print generics in full.
        type_name = field.type.__name__ if isinstance(field.type, type) else str(field.type).replace("typing.", "")
        yield field.name, type_name, default, " ".join(help_text.split())


def config_fields_table() -> str:
    """Markdown table of POISE's own fields (added ones, then those whose default differs from `GRPOConfig`'s)."""
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, type_name, default, help_text in poise_fields():
        rows.append(f"| `{name}` | `{type_name}` | {default} | {_cell(help_text)} |")
    return "\n".join(rows)


def presets_table() -> str:
    """Markdown table of the probe presets, one row per setting: what each preset gives it (required ones marked),
    and what a user gets by default (`POISEConfig`'s default preset); "-" where a preset leaves the field's own
    default."""
    from poise_trl.choices import DEFAULT_PRESET, PROBE_PRESETS

    columns = {"paper": "paper", "reference": "reference (the authors' recipe)", "release": "release"}
    names = list(PROBE_PRESETS)
    assert set(columns) == set(names), "a new preset needs its column heading here"
    settings = {key: None for preset in PROBE_PRESETS.values() for key in (*preset.settings, *preset.domain_settings)}

    def cell(name: str, key: str) -> str:
        preset = PROBE_PRESETS[name]
        if key in preset.domain_settings:
            return f"`{preset.domain_settings[key]!r}` with a `probe_domain_column`"
        if key not in preset.settings:
            return "-"
        return f"`{preset.settings[key]!r}`" + (" (required)" if key in preset.required else "")

    header = ["setting", *(columns[name] for name in names), f"by default (`{DEFAULT_PRESET!r}`)"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key in settings:
        cells = [cell(name, key) for name in (*names, DEFAULT_PRESET)]
        rows.append(f"| `{key}` | " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows)


def scalars_table() -> str:
    """Markdown table of the rollout scalars `probe_scalars` takes, in the table's order, the default's marked."""
    from poise_trl.features.columns import DEFAULT_SCALARS, SCALARS

    rows = ["| `probe_scalars` name | what it is |", "|---|---|"]
    for name, scalar in SCALARS.items():
        default = " (default)" if name in DEFAULT_SCALARS else ""
        rows.append(f"| `{name}`{default} | {_cell(scalar.help)} |")
    return "\n".join(rows)


def contract_table() -> str:
    """Markdown table of the TRL contract (poise_trl/grpo/contract.py): each behaviour, what POISE does with it, the
    TRL names it reads or writes (a `RepeatSampler`'s prefixed) and the overrides that rely on it."""
    from poise_trl.grpo.contract import CONTRACT

    rows = ["| behaviour | what holds in TRL | what POISE does with it | TRL names, overrides |", "|---|---|---|---|"]
    for name, b in CONTRACT.items():
        names = ", ".join(f"`{n}`" if b.owner == "GRPOTrainer" else f"`{b.owner}.{n}`" for n in b.names)
        names = ", ".join(filter(None, (names, *(f"`{n}`" for n in b.overrides)))) or "-"
        rows.append(f"| `{name}` | {_cell(b.holds)} | {_cell(b.because)} | {_cell(names)} |")
    return "\n".join(rows)


def changelog_markdown(root: Path) -> str:
    """CHANGELOG.md with its links into `docs/` made relative to the changelog page, which sits in `docs/`."""
    return re.sub(r"\]\(docs/", "](", (root / "CHANGELOG.md").read_text())


def on_page_markdown(markdown: str, page, config, files) -> str:
    if CHANGELOG_INCLUDE in markdown:
        markdown = markdown.replace(CHANGELOG_INCLUDE, changelog_markdown(Path(config["config_file_path"]).parent))
    tables = {
        MARKER: config_fields_table,
        PRESETS_MARKER: presets_table,
        SCALARS_MARKER: scalars_table,
        CONTRACT_MARKER: contract_table,
    }
    for marker, table in tables.items():
        if marker in markdown:
            markdown = markdown.replace(marker, table())
    return markdown


def mathjax_root() -> Path:
    spec = importlib.util.find_spec("mathjax")
    root = Path(next(iter(spec.submodule_search_locations))) / "static" / "mathjax" if spec else None
    if root is None or not (root / "es5" / MATHJAX_FILES[0]).is_file():
        raise FileNotFoundError(
            "MathJax is served by the site from the `django-static-mathjax` package: install the docs tools with "
            "`pip install -e '.[dev]'`."
        )
    return root


def on_files(files, config):
    """Add MathJax (bundle, fonts, autoloaded TeX extensions, licence) to the site's files."""
    root = mathjax_root()
    sources = [root / "LICENSE"] + [path for pattern in MATHJAX_FILES for path in sorted((root / "es5").glob(pattern))]
    for source in sources:
        relative = source.relative_to(root / "es5") if source.name != "LICENSE" else Path("LICENSE")
        files.append(File.generated(config, f"{MATHJAX_DIR}/{relative.as_posix()}", abs_src_path=str(source)))
    return files


def _reference(match: re.Match) -> str:
    """A doc-builder reference as a Markdown link: TRL's names to TRL's docs, ours to the API page (autorefs)."""
    import poise_trl

    tilde, path = match.group(1), match.group(2)
    shown = path.rsplit(".", 1)[-1] if tilde else path
    if path.startswith("trl."):
        name = path.removeprefix("trl.")
        if name not in TRL_PAGES:
            raise ValueError(f"[`{tilde}{path}`]: add {name}'s TRL docs page to TRL_PAGES in docs/hooks.py")
        return f"[`{shown}`]({TRL_DOCS}/{TRL_PAGES[name]}#trl.{name})"
    target = getattr(poise_trl, path.rsplit(".", 1)[-1])  # AttributeError: not a public name of poise_trl
    return f"[`{shown}`][{target.__module__}.{target.__qualname__}]"


def markdown_docstring(text: str) -> str:
    """Doc-builder references linked; a blank line before a list that directly follows a paragraph line."""
    text = re.sub(r"\[`(~?)([\w.]+)`\](?![\[(])", _reference, text)
    lines, in_list = [], False
    for line in text.splitlines():
        item = re.match(r"\s*(?:[-*]|\d+\.)\s", line) is not None
        if item and not in_list and lines and lines[-1].strip():
            lines.append("")
        in_list = (item or in_list) and bool(line.strip())
        lines.append(line)
    return "\n".join(lines)


class TRLDocstrings(griffe.Extension):
    """Render docstrings written in TRL's conventions, and list `POISEConfig`'s parameters from its field help."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """A `default_factory` field's default as its value, not griffe's `(lambda: [...])()`: griffe's dataclasses
        extension writes the factory call into the `__init__` it generates. It runs after this one, so it is run
        here first (it skips classes that already have an `__init__`)."""
        if pkg.path != "poise_trl":
            return
        from poise_trl import POISEConfig

        griffe.DataclassesExtension().on_package(pkg=pkg)

        fields = dataclasses.fields(POISEConfig)
        factories = {f.name: f for f in fields if f.default_factory is not dataclasses.MISSING}
        for parameter in pkg["grpo.config.POISEConfig"].members["__init__"].parameters:
            if parameter.name in factories:
                parameter.default = repr(_default(factories[parameter.name]))

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.is_alias or obj.docstring is None:
            return
        obj.docstring.value = markdown_docstring(obj.docstring.value)
        if obj.path == "poise_trl.grpo.config.POISEConfig":
            entries = [
                f"    {name} ({type_name}): {help_text} Default: {default}."
                for name, type_name, default, help_text in poise_fields()
            ]
            obj.docstring.value += "\n\nParameters:\n" + "\n".join(entries)
