"""Every table of benchmark figures in README.md and the docs pages names the committed JSON it
comes from, and every number in it is in that JSON.

A table of figures is marked by an HTML comment on the line before it, ``<!-- figures:
docs/bench/NAME.json -->``; a table with figure-like cells (a time, a rate, a ratio) that is
not benchmark output says so with ``<!-- not figures: why -->``. In a marked table every number
outside the first column (the row's label) must equal a number of the JSON -- a numeric value,
or a number inside one of its strings -- at the precision the README shows it, directly or
converted to KiB, MiB, GiB, percent or millions. (A check by value: a figure that happens to equal
another number of a large JSON passes.) The JSON is written by the bench script, so a figure
typed by hand, or left over from an older run, fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"<!--\s*(figures|not figures):?\s*([^>]*?)\s*-->")
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")
FIGURE = re.compile(r"\d[\d,.]*\s*(?:ms\b|×|x\b|/s\b|MiB|GiB|steps/s)")


def tables(text: str) -> list[tuple[int, list[str], str | None]]:
    """(line number, table lines, the marker line before it or None)."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        if lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            before = next((lines[k] for k in range(i - 1, max(i - 3, -1), -1)
                           if lines[k].strip()), None)
            out.append((i + 1, lines[i:j], before if before and MARK.search(before) else None))
            i = j
        else:
            i += 1
    return out


def cells(table: list[str]) -> list[str]:
    """The body's cells, first column (the label) and code spans left out."""
    body = [row.strip().strip("|").split("|") for row in table[2:]]
    return [re.sub(r"`[^`]*`", "", c) for row in body for c in row[1:]]


def numbers_of(value, out: set[float]) -> set[float]:
    if isinstance(value, bool):
        return out
    if isinstance(value, (int, float)):
        out.add(float(value))
    elif isinstance(value, str):
        out.update(float(n.replace(",", "")) for n in NUMBER.findall(value))
    elif isinstance(value, dict):
        for v in value.values():
            numbers_of(v, out)
    elif isinstance(value, list):
        for v in value:
            numbers_of(v, out)
    return out


def shown(token: str, numbers: set[float]) -> bool:
    digits = len(token.split(".")[1]) if "." in token else 0
    x = float(token.replace(",", ""))
    for v in numbers:
        for scaled in (v, v / 2 ** 10, v / 2 ** 20, v / 2 ** 30, v * 100, v / 1e6):
            # as is, KiB, MiB, GiB, percent, millions
            if abs(round(scaled, digits) - x) < 10 ** -(digits + 3):
                return True
    return False


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_of_figures_names_its_json_and_matches_it(page):
    text = page.read_text()
    name = str(page.relative_to(ROOT))
    problems = []
    for line, table, marker in tables(text):
        figures = [c for c in cells(table) if FIGURE.search(c)]
        if marker is None:
            if figures:
                problems.append(f"{name}:{line}: a table of figures ({figures[0].strip()!r}) "
                                "without <!-- figures: docs/bench/X.json -->")
            continue
        kind, what = MARK.search(marker).groups()
        if kind == "not figures":
            assert what, f"{name}:{line}: say why the table is not figures"
            continue
        path = ROOT / what
        assert path.is_file(), f"{name}:{line}: {what} does not exist"
        numbers = numbers_of(json.loads(path.read_text()), set())
        for cell in cells(table):
            for token in NUMBER.findall(cell):
                if not shown(token, numbers):
                    problems.append(f"{name}:{line}: {token} (in {cell.strip()!r}) is not "
                                    f"in {what}")
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_figure_typed_by_hand():
    numbers = {207.7808, 0.9367, 21773.18, 2 ** 30 * 2.33}
    assert shown("207.8", numbers) and shown("0.94", numbers) and shown("21,773", numbers)
    assert shown("2.33", numbers)  # GiB
    assert not shown("207.9", numbers) and not shown("1.22", numbers)


# Cited JSONs measured on a tree with uncommitted changes, before `omniscale bench all
# --write-docs` (which refuses a dirty tree) existed. The list only shrinks: a JSON measured
# again comes out clean and must leave it; any other cited JSON must record a clean tree.
MEASURED_DIRTY = frozenset()
# measured from a `git archive` export outside a checkout (each JSON's note says which code):
# no git state
NO_GIT = frozenset({"balance_scale_before.json", "plane_ramp_before.json"})


def test_no_cited_figure_is_newly_measured_on_a_dirty_tree():
    from omniscale.tools.bench.docs_page import citations, provenance

    dirty, cleaned = [], []
    for name in set(citations()) - NO_GIT:
        path = ROOT / "docs" / "bench" / name
        recorded = provenance(json.loads(path.read_text())).get("git_dirty")
        if name in MEASURED_DIRTY:
            if recorded is False:
                cleaned.append(name)
        elif recorded is not False:  # True, or no provenance at all
            dirty.append(f"{name}: git_dirty {recorded}")
    assert not dirty, "measured on a tree with uncommitted changes (or not recorded):\n" + \
        "\n".join(dirty)
    assert not cleaned, f"measured clean now; take them off MEASURED_DIRTY: {cleaned}"


def test_the_readme_headlines_come_from_one_clean_commit():
    """The landing page's figures are regenerated together (`omniscale bench all --write-docs
    --only ...` and the demo's report, at one commit), so a reader compares them as one state of
    the code, not a mix of runs months apart."""
    from omniscale.tools.bench.docs_page import citations, provenance

    readme = sorted(name for name, pages in citations().items() if "README.md" in pages)
    assert len(readme) >= 8, f"the README's headlines should name their JSONs in full: {readme}"
    commits = {}
    for name in readme:
        data = provenance(json.loads((ROOT / "docs" / "bench" / name).read_text()))
        assert data.get("git_dirty") is False, f"{name}: measured on a dirty tree"
        commits.setdefault(data.get("git_commit"), []).append(name)
    assert len(commits) == 1, "the README's JSONs come from several commits: " + "; ".join(
        f"{(c or 'none')[:10]}: {', '.join(n)}" for c, n in commits.items())
