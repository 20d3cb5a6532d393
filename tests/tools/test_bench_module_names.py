"""No module beside a documented script may have the name of an installed package.

``python tools/bench/model.py`` puts ``tools/bench`` first on ``sys.path``, so a
``tools/bench/kernels.py`` stood in for Hugging Face's ``kernels`` package when transformers
imported it (``ImportError: cannot import name 'CUDAProperties' from 'kernels'``), and the
model and HF-loading benches failed on a fresh install. This checks every folder a documented
script is run from against the names installed in this environment and the standard library.
"""

from __future__ import annotations

import importlib.metadata
import pkgutil
import re
import site
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Where scripts are documented: a `python path/to/x.py` there runs with x's folder first on
# sys.path. tools/bench is always checked, however the docs change.
DOC_FILES = ("README.md", "Makefile", "docs/*.md", "docs/**/*.md", "tools/**/*.py",
             "tools/**/*.sh")
SCRIPT_RUN = re.compile(r"python[0-9.]*\s+(?!-)((?:[\w.-]+/)*[\w.-]+\.py)\b")


def script_folders() -> set[Path]:
    folders = {REPO / "tools" / "bench"}
    for pattern in DOC_FILES:
        for doc in REPO.glob(pattern):
            if ".venv" in doc.parts:
                continue
            for rel in SCRIPT_RUN.findall(doc.read_text(errors="replace")):
                script = REPO / rel
                if script.is_file():
                    folders.add(script.parent)
    return folders


def module_names(folder: Path) -> dict[str, Path]:
    """Top-level names importable from ``folder`` when it is on sys.path: modules, extension
    modules and regular packages (a folder without ``__init__.py`` is only a namespace
    portion, which any installed package of that name takes precedence over)."""
    names = {}
    for path in folder.iterdir():
        if path.is_file() and path.suffix in (".py", ".so", ".pyd"):
            names[path.name.split(".")[0]] = path
        elif path.is_dir() and (path / "__init__.py").is_file():
            names[path.name] = path
    return names


def installed_names() -> dict[str, str]:
    """Every top-level name this environment can import from elsewhere: what is in
    site-packages, each distribution's top-level modules, and the standard library; the
    value says where it comes from."""
    ours = "omniscale"
    found: dict[str, str] = {}
    for name in sys.stdlib_module_names | set(sys.builtin_module_names):
        found[name] = "the standard library"
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    for module in pkgutil.iter_modules([d for d in dirs if Path(d).is_dir()]):
        found.setdefault(module.name, "site-packages")
    for name, dists in importlib.metadata.packages_distributions().items():
        others = [d for d in dists if d.lower() != ours]
        if others:
            found[name] = f"installed distribution {', '.join(sorted(set(others)))}"
    found.pop(ours, None)
    return found


def clashes(folder: Path, installed: dict[str, str], root: Path = REPO) -> list[str]:
    return [f"{path.relative_to(root)}: shadows `{name}` ({installed[name]}) when a "
            f"script in {folder.name}/ runs" for name, path in sorted(module_names(folder).items())
            if name in installed]


def test_the_clash_check_finds_a_known_clash(tmp_path):
    """The oracle: numpy and torch are installed (dependencies), json is the standard library;
    a folder with modules of those names must be reported, one of a fresh name not."""
    for name in ("numpy.py", "json.py", "harmless_bench_name_xyz.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    (tmp_path / "webdataset").mkdir()  # no __init__.py: a namespace portion, no shadow
    found = clashes(tmp_path, installed_names(), root=tmp_path.parent)
    assert [line.split(":")[0] for line in found] == [
        f"{tmp_path.name}/json.py", f"{tmp_path.name}/numpy.py", f"{tmp_path.name}/torch"]


def test_documented_script_folders_include_the_benches():
    folders = script_folders()
    assert REPO / "tools" / "bench" in folders
    assert all(f.is_relative_to(REPO) for f in folders)


def test_no_module_beside_a_documented_script_shadows_an_installed_package():
    installed = installed_names()
    assert {"torch", "numpy", "json"} <= set(installed)  # not an empty list by mistake
    problems = [line for folder in sorted(script_folders())
                for line in clashes(folder, installed)]
    assert not problems, "rename these modules:\n" + "\n".join(problems)
