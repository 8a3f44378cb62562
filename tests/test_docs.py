"""The README and docs/ stay navigable: every relative link resolves (its file, and its #anchor to a heading of
that file), every docs page is linked from the README and links back, and the code map names every module (a
package's `__init__.py` may go without a line: its section stands for it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(page: Path) -> str:
    """The page without its fenced code blocks (a `](` in a command is not a link)."""
    return re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", _prose(page), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target}: no heading with that anchor")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme_and_back():
    readme = _prose(ROOT / "README.md")
    unlinked = [f"docs/{p.name}" for p in PAGES[1:] if f"](docs/{p.name}" not in readme]
    no_way_back = [f"docs/{p.name}" for p in PAGES[1:] if "](../README.md" not in _prose(p)]
    assert not unlinked, f"the README links to none of: {unlinked}"
    assert not no_way_back, f"these pages do not link back to the README: {no_way_back}"


def test_the_code_map_names_every_module():
    code_map = (ROOT / "docs" / "code-map.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([^`]+)` \|", code_map, re.M))
    modules = {
        str(p.relative_to(ROOT))
        for package in ("cli", "core", "io")
        for p in (ROOT / package).rglob("*.py")
        if "__pycache__" not in p.parts and p.name != "__init__.py"  # (a package's own line is optional)
    }
    assert not modules - listed, f"docs/code-map.md has no line for: {sorted(modules - listed)}"
    gone = {m for m in listed - modules if not (ROOT / m).exists()}
    assert not gone, f"docs/code-map.md lists modules that are not there: {sorted(gone)}"
