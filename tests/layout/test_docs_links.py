"""Every relative link in README.md and docs/*.md names a file that exists and, with a `#anchor`, a
heading of that file (GitHub's anchors), so the reference's cross-links do not rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = next(parent for parent in Path(__file__).resolve().parents if (parent / "pyproject.toml").exists())
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# docs/settings.md is generated from the settings registry (vllm_actors.envs, a module or a package);
# links to it are checked once the registry exists.
REGISTRY = (ROOT / "src" / "vllm_actors" / "envs.py", ROOT / "src" / "vllm_actors" / "envs")
GENERATED = {ROOT / "docs" / "settings.md": REGISTRY}

FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text without code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("code", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    result = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        slug_ = slug(heading)
        count = seen.get(slug_, 0)
        seen[slug_] = count + 1
        result.add(slug_ if count == 0 else f"{slug_}-{count}")
    return result


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        sources = GENERATED.get(path)
        if sources is not None and not any(source.exists() for source in sources):
            continue
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (path.suffix != ".md" or anchor not in anchors(path)):
            broken.append(f"{target}: no heading with this anchor")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_readme_links_every_docs_page() -> None:
    readme = prose((ROOT / "README.md").read_text())
    index = prose((ROOT / "docs" / "index.md").read_text())
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme or page.name == "index.md", f"README does not link {page.name}"
        assert page.name in index or page.name == "index.md", f"docs/index.md does not list {page.name}"


def test_anchor_slugs_follow_github() -> None:
    assert slug("Embedding: `AsyncEngineClient` and `build_app`") == "embedding-asyncengineclient-and-build_app"
    assert slug("Replica sets (data parallelism) and Ray") == "replica-sets-data-parallelism-and-ray"
