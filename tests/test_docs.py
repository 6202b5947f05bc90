"""The documentation's links resolve: every relative markdown link in the repository's markdown files (README.md,
docs/, SECURITY.md, ...) names a file or folder that exists, and every ``#anchor`` names a heading of its target
(GitHub's rule: lowercase, spaces to ``-``, punctuation other than ``-`` and ``_`` dropped, ``-1``, ``-2`` for
repeats). docs/README.md lists every page of docs/, and the README stays a newcomer's page. No network: links to
``http(s)://`` and ``mailto:`` are not followed."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def markdown_files() -> list[Path]:
    """The repository's own markdown files: at its root, in docs/, bench/, examples/ and infra/ (not in a virtualenv
    or a run folder, which hold other projects' files)."""
    found = {*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"), *(ROOT / "bench").glob("*.md")}
    for folder in ("examples", "infra"):
        found |= set((ROOT / folder).rglob("*.md"))
    return sorted(found)


def without_code(text: str) -> str:
    """The text outside fenced blocks and inline code: a link or heading in code is not one."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lowercase, punctuation but ``-``/``_`` removed,
    each space a ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor in a markdown text, repeats numbered as GitHub does (``x``, ``x-1``, ``x-2``)."""
    seen: dict[str, int] = {}
    out = set()
    for match in _HEADING.finditer(_FENCE.sub("", text)):
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(text: str) -> list[str]:
    return [m.group(1) for m in _LINK.finditer(without_code(text))]


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """The links of one markdown file (``text`` instead of its content, for tests) that do not resolve."""
    text = path.read_text() if text is None else text
    broken = []
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...: not followed
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and (dest.is_dir() or dest.suffix != ".md"):
            broken.append(f"{target}: an anchor into something that is not a markdown file")
        elif anchor and anchor not in anchors(dest.read_text()):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    return broken


def test_every_relative_link_and_anchor_resolves():
    files = markdown_files()
    assert ROOT / "README.md" in files and ROOT / "docs" / "README.md" in files, files
    broken = {str(p.relative_to(ROOT)): b for p in files if (b := broken_links(p))}
    assert broken == {}


def test_the_link_check_finds_a_broken_file_a_broken_anchor_and_passes_good_ones():
    page = ROOT / "README.md"
    text = ("[ok](docs/tasks.md) [ok](docs/tasks.md#pitfalls) [ok](#exit-codes) [ok](https://example.com/x#y)\n"
            "[bad](docs/no-such-page.md) [bad](docs/tasks.md#no-such-heading) [bad](#no-such-section)\n"
            "`[code](not-checked.md)`\n```\n[code](not-checked-either.md)\n```\n")
    assert broken_links(page, text) == [
        "docs/no-such-page.md: no such file",
        "docs/tasks.md#no-such-heading: no heading with that anchor in docs/tasks.md",
        "#no-such-section: no heading with that anchor in README.md",
    ]


@pytest.mark.parametrize(("heading", "anchor"), [
    ("Spot VMs (systemd or `supervise.sh`)", "spot-vms-systemd-or-supervisesh"),
    ("With the adapter: `DatasetTask`", "with-the-adapter-datasettask"),
    ("More cuts: covering the data order, and resumes of resumes",
     "more-cuts-covering-the-data-order-and-resumes-of-resumes"),
    ("S3 on a real server (Ceph RGW)", "s3-on-a-real-server-ceph-rgw"),
    ("Tested (`tests/test_train_fsdp.py`, 8 tests, ~3 min on a 2-core machine)",
     "tested-teststest_train_fsdppy-8-tests-3-min-on-a-2-core-machine"),
    ("Exit codes", "exit-codes"),
])
def test_anchors_follow_githubs_rule(heading, anchor):
    assert slug(heading) == anchor
    assert anchors(f"# {heading}\n\n## {heading}\n") == {anchor, f"{anchor}-1"}


def test_docs_readme_lists_every_page_and_the_readme_links_it():
    toc = (ROOT / "docs" / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    assert [p for p in pages if f"]({p})" not in toc] == []
    readme = (ROOT / "README.md").read_text()
    assert "](docs/README.md)" in readme
    assert [p for p in pages if f"](docs/{p}" not in readme] == []  # "where to read on" names every page


def test_the_readme_is_a_newcomers_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES
