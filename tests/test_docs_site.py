"""The docs: README.md is a landing page, the pages under docs/ build as a site with
``mkdocs build --strict`` (a broken link, a missing anchor or a page left out of the nav fails),
and every link the README gives leads to a file of the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200  # issue #45: a landing page, the reference lives in docs/


def test_the_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md: {len(lines)} lines"
    # the two commands are the first code block: .ci/run runs the second exactly
    first = re.search(r"```bash\n(.*?)```", "\n".join(lines), re.S).group(1).splitlines()
    assert [c.split()[:2] for c in first] == [["make", "demo"], ["make", "test"]], first


def test_every_readme_link_leads_to_a_file():
    text = (ROOT / "README.md").read_text()
    links = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", text)
             if not t.startswith(("http://", "https://"))]
    assert links and all((ROOT / t).exists() for t in links), \
        [t for t in links if not (ROOT / t).exists()]


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "guides" / "fine-tune-hf" / "index.html").is_file()


def test_every_page_is_in_the_nav():
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def pages(entries):
        for entry in entries:
            for value in entry.values():
                yield from pages(value) if isinstance(value, list) else [value]
    listed = set(pages(nav))
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == listed, (on_disk - listed, listed - on_disk)
