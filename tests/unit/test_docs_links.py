"""Every link, anchor and image of the README and the docs site resolves: a page, a heading on it,
a picture that is there. Checked by reading the Markdown as mkdocs does (headings slugged by its
`toc` extension), so a renamed section or a moved picture fails here, not in a reader's browser."""

from __future__ import annotations

import re
from pathlib import Path

from markdown.extensions.toc import slugify

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(!?)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    return FENCE.sub("", text)


def anchors(page: Path) -> set[str]:
    """The ids mkdocs gives the page's headings (a repeated heading gets `_1`, `_2`, ...)."""
    seen: dict[str, int] = {}
    ids = set()
    for heading in HEADING.findall(_prose(page.read_text(encoding="utf-8"))):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        slug = slugify(text, "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        ids.add(slug if count == 0 else f"{slug}_{count}")
    return ids


def broken_links(page: Path) -> list[str]:
    """Each link or image of `page` whose file, or heading on that file, does not exist."""
    broken = []
    prose = INLINE_CODE.sub("", _prose(page.read_text(encoding="utf-8")))
    for image, target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        found = (page.parent / path).resolve() if path else page
        what = "image" if image else "link"
        if not found.is_file():
            broken.append(f"{page.name}: {what} {target}: no file {path}")
        elif anchor and found.suffix == ".md" and anchor not in anchors(found):
            broken.append(f"{page.name}: {what} {target}: no heading #{anchor} on {found.name}")
    return broken


def test_every_link_anchor_and_image_of_the_docs_resolves():
    assert len(PAGES) > 20
    assert [b for page in PAGES for b in broken_links(page)] == []


def test_a_missing_image_is_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.png").write_bytes(b"\x89PNG")
    page.write_text("# Page\n\n![a plot](there.png)\n\n![a plot](gone.png)\n\n```bash\n![not](in-code.png)\n```\n")
    assert broken_links(page) == ["page.md: image gone.png: no file gone.png"]


def test_a_broken_anchor_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Skewed traffic: k = 3\n\n## `kvrag ab` flags\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n## Here\n\n[ok](other.md#skewed-traffic-k-3), [ok](other.md#kvrag-ab-flags), "
                    "[ok](#here), [gone](other.md#stores-and-tiers), [gone](#there)\n")
    assert broken_links(page) == ["page.md: link other.md#stores-and-tiers: no heading #stores-and-tiers on other.md",
                                  "page.md: link #there: no heading #there on page.md"]
