"""The built docs site as a reader sees it: `mkdocs build --strict` into a temporary folder, then the text of every
page (code and typeset math aside) is checked for what a broken render leaves behind."""

import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


class PageText(HTMLParser):
    """A page's text outside code blocks (`text`, inline code included), its prose (`prose`: also outside inline code
    and MathJax's `arithmatex` spans), its h1s and its script sources."""

    VOID = {"br", "img", "input", "meta", "link", "hr", "wbr", "source"}

    def __init__(self):
        super().__init__()
        self.text: list[str] = []
        self.prose: list[str] = []
        self.h1: list[str] = []
        self.scripts: list[str] = []
        self._stack: list[tuple[str, bool, bool]] = []  # (tag, outside the text, outside the prose)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script" and attrs.get("src"):
            self.scripts.append(attrs["src"])
        if tag in self.VOID:
            return
        block = tag in ("pre", "script", "style")
        inline = tag == "code" or "arithmatex" in (attrs.get("class") or "").split()
        self._stack.append((tag, block, block or inline))
        if tag == "h1":
            self.h1.append("")

    def handle_endtag(self, tag):
        while self._stack:
            if self._stack.pop()[0] == tag:
                break

    def handle_data(self, data):
        if any(block for _, block, _ in self._stack):
            return
        self.text.append(data)
        if not any(skip for _, _, skip in self._stack):
            self.prose.append(data)
        if any(tag == "h1" for tag, _, _ in self._stack):
            self.h1[-1] += data


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent), "HOME": str(out)}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _pages(site: Path) -> dict[str, PageText]:
    pages = {}
    for path in sorted(site.rglob("*.html")):
        parser = PageText()
        parser.feed(path.read_text())
        pages[str(path.relative_to(site))] = parser
    return pages


def test_every_page_renders_its_markup(site):
    pages = _pages(site)
    sources = {"index.html" if md.stem == "index" else f"{md.stem}/index.html" for md in (ROOT / "docs").glob("*.md")}
    assert sources <= set(pages) and "from-grpo/index.html" in sources
    for name, page in pages.items():
        prose = "".join(page.prose)
        assert [h for h in page.h1 if h.strip()], f"{name} has no heading"
        for raw in ("\\[", "\\(", "$$"):  # math MathJax did not get: outside the arithmatex spans
            assert raw not in prose, f"{name} shows raw math {raw!r}"
        assert "\\|" not in "".join(page.text), f"{name} shows an escaped pipe"
        html = (site / name).read_text()  # [`POISETrainer`] left as text renders as [<code>POISETrainer</code>]
        leftovers = re.findall(r"\[<code>[^<]*</code>\]", html)
        assert "[~trl." not in html and not leftovers, f"{name} shows doc-builder references as text: {leftovers}"


def test_mathjax_is_served_by_the_site(site):
    pages = _pages(site)
    for name, page in pages.items():
        assert not any(src.startswith(("http:", "https:", "//")) for src in page.scripts), (name, page.scripts)
    how = (site / "how-it-works" / "index.html").read_text()
    assert how.count('class="arithmatex"') >= 10
    bundle = site / "assets" / "mathjax" / "tex-mml-chtml.js"
    assert bundle.stat().st_size > 500_000 and "assets/mathjax/tex-mml-chtml.js" in how
    assert list((site / "assets" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2").glob("MathJax_Main-*.woff"))
    assert (site / "assets" / "mathjax" / "LICENSE").read_text().split()[:2] == ["Apache", "License"]


def test_generated_tables_and_api_page_read_right(site):
    configuration = "".join(_pages(site)["configuration/index.html"].prose)
    api = (site / "api" / "index.html").read_text()
    assert "<code>int | None</code>" in (site / "configuration" / "index.html").read_text()
    assert "probe_layer_candidates" in api and "from_grpo_config" in api
    # TRL's names link to TRL's docs, ours to their anchors; the overrides are a list, not one paragraph.
    assert 'href="https://huggingface.co/docs/trl/grpo_trainer#trl.GRPOConfig"' in api
    assert 'href="#poise_trl.grpo.trainer.POISETrainer"' in api
    overrides = api.split("Overrides of TRL's methods (all of them", 1)[1].split("</ul>", 1)[0]
    assert overrides.count("<li>") == 8
    assert "Rollouts per prompt" in configuration


def test_api_page_leads_with_the_public_api_and_renders_defaults_as_values(site):
    """`poise_trl.__all__` is the API page's first table, in order, each name rendered on the page; the internals
    have a page of their own; a `default_factory` default reads as its value; no source path appears as text."""
    import poise_trl

    page = (ROOT / "docs" / "api.md").read_text()
    listed = re.findall(r"^\| \[`(\w+)`\]\(#", page, re.M)
    assert listed == poise_trl.__all__
    assert all(getattr(poise_trl, name) is not None for name in poise_trl.__all__)
    api = (site / "api" / "index.html").read_text()
    for name in poise_trl.__all__:
        assert re.search(rf'id="poise_trl(\.\w+)+\.{name}"', api), f"{name} is not rendered on the API page"
    assert (
        'id="poise_trl.estimator.baselines.cross_rollout_baselines"'
        in (site / "api-internals" / "index.html").read_text()
    )
    text = "".join(_pages(site)["api/index.html"].text)
    assert "lambda" not in text and "['prompt', 'reasoning', 'entropy']" in text
    assert "docs/configuration.md" not in text
