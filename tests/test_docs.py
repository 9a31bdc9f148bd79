"""The docs a newcomer reads: every relative link in README.md and docs/ names a file that exists and,
with a `#section`, a heading that exists (GitHub's anchors); the README stays short."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors_of(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '# comment' in a code block is no heading
    return {github_anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def broken_links(page: Path) -> list[str]:
    broken = []
    for link in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", link):  # http(s), mailto: not ours to check offline
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link} (no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path})")
        elif anchor and path.suffix == ".md" and anchor not in anchors_of(path):
            broken.append(f"{link} (no heading '#{anchor}')")
    return broken


def test_every_relative_link_and_anchor_resolves():
    broken = {page.name: broken_links(page) for page in PAGES}
    assert not {name: links for name, links in broken.items() if links}


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A heading\n\n[ok](#a-heading) [gone](#no-such) [missing](nowhere.md)\n")
    assert broken_links(page) == ["#no-such (no heading '#no-such')", f"nowhere.md (no file {tmp_path / 'nowhere.md'})"]


def test_readme_is_at_most_10_kb():
    assert len((ROOT / "README.md").read_bytes()) <= 10_000  # 10 KB, as the issue counts them
