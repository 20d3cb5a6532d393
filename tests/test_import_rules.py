"""The table of allowed imports between the project's packages (DESIGN.md's layout table),
checked whole on the source text (nothing is imported).

Each package lists the project packages it may import and, for the packages that must stay
light or pure, the third-party modules too. The root ``omniscale/`` holds the shared
vocabulary (errors, sample refs, index schema, media kinds, geometry, layout, locations) and
imports no other package of the project; every package may import it. Above the table:
no folder cycles, and every import of the project's own code goes through the one installed
name, ``omniscale`` (``import dataplane`` would load a second copy of a module from a checkout,
and does not exist in an installed wheel).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dataplane", "loaders", "balancer", "encoders", "backbone", "parallel", "kernels",
            "tools")
VOCABULARY = "omniscale"  # the package root's own modules

# package -> the project packages its modules may import (the vocabulary is always allowed).
ALLOWED = {
    VOCABULARY: set(),
    "balancer": set(),
    "kernels": set(),
    "dataplane": {"balancer"},
    "loaders": {"dataplane", "balancer"},
    "encoders": {"kernels"},
    "backbone": {"kernels", "encoders"},
    "parallel": {"kernels", "encoders", "backbone"},
    "tools": set(PACKAGES),
}
# Where a package may reach into another only through some of its modules.
ONLY_THROUGH = {
    # the client side of the plane, and the spec (``data index`` indexes a spec's sources)
    ("loaders", "dataplane"): {"client", "local", "actions", "spec"},
    ("loaders", "balancer"): {"types"},
}
# Third-party modules a package may import, for the packages held to a short list (the rest
# may use any declared dependency); the standard library is always allowed.
THIRD_PARTY = {
    VOCABULARY: {"numpy", "pyarrow",
                 "fsspec"},  # Location.filesystem opens an object store, imported when called
    "balancer": {"numpy", "numba"},
}
# Never imported by these packages, whatever the table says.
FORBIDDEN = {
    # parallelism is applied from outside by parallel/ (torchtitan's rule)
    "encoders": ("torch.distributed",),
    "backbone": ("torch.distributed",),
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module.count(".") < 2 and node.module.split(".")[0] == "omniscale":
                # `from omniscale.dataplane import wire` imports omniscale.dataplane.wire
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def package_files(package: str) -> list[Path]:
    if package == VOCABULARY:
        # __main__ is the command's entry point (it starts the CLI), not vocabulary
        return sorted(p for p in (ROOT / VOCABULARY).glob("*.py") if p.name != "__main__.py")
    return sorted((ROOT / package).rglob("*.py"))


def project_target(module: str) -> tuple[str, str] | None:
    """``omniscale.loaders.chunks`` -> ("loaders", "chunks"); a vocabulary module ->
    ("omniscale", name); not the project's -> None."""
    parts = module.split(".")
    if parts[0] != "omniscale":
        return None
    if len(parts) == 1 or parts[1] not in PACKAGES:
        return VOCABULARY, parts[1] if len(parts) > 1 else ""
    return parts[1], parts[2] if len(parts) > 2 else ""


def violations(package: str) -> dict[str, list[str]]:
    stdlib = set(sys.stdlib_module_names)
    bad: dict[str, list[str]] = {}
    for path in package_files(package):
        wrong = []
        for module in sorted(imported_modules(path)):
            target = project_target(module)
            if target is None:
                top = module.split(".")[0]
                if package in THIRD_PARTY and top not in stdlib | THIRD_PARTY[package]:
                    wrong.append(module)
                if any(module == f or module.startswith(f + ".")
                       for f in FORBIDDEN.get(package, ())):
                    wrong.append(module)
                continue
            to, submodule = target
            if to in (package, VOCABULARY):
                continue
            if to not in ALLOWED[package]:
                wrong.append(module)
            elif (package, to) in ONLY_THROUGH and submodule not in ONLY_THROUGH[package, to]:
                wrong.append(module)
        if wrong:
            bad[str(path.relative_to(ROOT))] = wrong
    return bad


@pytest.mark.parametrize("package", [VOCABULARY, *PACKAGES])
def test_package_imports_only_what_the_table_allows(package):
    assert violations(package) == {}


def test_the_table_catches_a_forbidden_import(tmp_path, monkeypatch):
    # the check itself must fail on a break: a backbone module reaching into the plane
    fake = tmp_path / "backbone"
    fake.mkdir()
    (fake / "bad.py").write_text("from omniscale.dataplane.plane import DataPlane\n"
                                 "import torch.distributed as dist\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations("backbone") == {
        "backbone/bad.py": ["omniscale.dataplane.plane", "torch.distributed"]}


def folder_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for package in (VOCABULARY, *PACKAGES):
        edges = set()
        for path in package_files(package):
            for module in imported_modules(path):
                target = project_target(module)
                if target and target[0] != package:
                    edges.add(target[0])
        graph[package] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of the directed graph as a path that ends where it starts, or []."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                return [*path[path.index(nxt):], nxt]
            if nxt not in done:
                found = visit(nxt, [*path, nxt])
                if found:
                    return found
        done.add(node)
        return []

    for node in sorted(graph):
        found = visit(node, [node])
        if found:
            return found
    return []


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_folder_cycles():
    assert find_cycle(folder_graph()) == []


def test_the_table_itself_has_no_cycle():
    assert find_cycle({p: q - {p} for p, q in ALLOWED.items()}) == []


def test_every_design_package_exists():
    for package in PACKAGES:
        assert (ROOT / package / "__init__.py").is_file(), package


def test_project_code_is_imported_under_omniscale():
    files = [p for d in (*PACKAGES, "tests", "omniscale")
             for p in sorted((ROOT / d).rglob("*.py"))]
    bad = {str(f.relative_to(ROOT)): sorted(m for m in imported_modules(f)
                                             if m.split(".")[0] in PACKAGES)
           for f in files}
    assert not {f: m for f, m in bad.items() if m}
