"""DESIGN.md's import rules, checked on the source text (nothing is imported).

- model packages (`encoders/`, `backbone/`) never import torch.distributed: parallelism is
  applied from outside by `parallel/`;
- `balancer/` is pure array code: numpy, numba and the standard library only;
- `dataplane/` reaches into `loaders/` only for the pure contract modules it plans from;
- every import of the project's own code goes through the one installed name, `omniscale`
  (`import dataplane` would load a second copy of the module from a checkout, and does not
  exist in an installed wheel).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dataplane", "loaders", "balancer", "encoders", "backbone", "parallel", "kernels",
            "tools")
LOADERS_CONTRACT = {f"omniscale.loaders.{m}" for m in ("geometry", "layout", "index_schema")}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def package_imports(package: str) -> dict[str, set[str]]:
    return {str(p.relative_to(ROOT)): imported_modules(p)
            for p in sorted((ROOT / package).rglob("*.py"))}


@pytest.mark.parametrize("package", ["encoders", "backbone"])
def test_model_packages_do_not_import_distributed(package):
    offenders = {f: sorted(m for m in mods if m.startswith("torch.distributed"))
                 for f, mods in package_imports(package).items()}
    assert not {f: m for f, m in offenders.items() if m}


def test_balancer_is_pure_array_code():
    allowed_third_party = {"numpy", "numba"}
    stdlib = set(sys.stdlib_module_names)
    bad = {}
    for f, mods in package_imports("balancer").items():
        wrong = sorted({m.split(".")[0] for m in mods if not m.startswith("omniscale.")}
                       - stdlib - allowed_third_party)
        wrong += sorted(m for m in mods if m.startswith("omniscale.")
                        and not m.startswith("omniscale.balancer"))
        if wrong:
            bad[f] = wrong
    assert not bad


def test_dataplane_uses_only_the_loaders_contract():
    bad = {}
    for f, mods in package_imports("dataplane").items():
        # `from omniscale.loaders.x import y` also records `...x.y`; judge the module part only.
        wrong = sorted(m for m in mods if m.startswith("omniscale.loaders")
                       and not any(m == c or m.startswith(c + ".") for c in LOADERS_CONTRACT))
        if wrong:
            bad[f] = wrong
    assert not bad


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
