"""The wheel installs one name, `omniscale`, and works on its own.

Builds the wheel from a copy of the tracked files (setuptools' PEP 517 backend, no network),
then checks its top-level names, that every folder with an ``__init__.py`` is inside it, the
console script, and that the unpacked wheel imports without the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from omniscale import SUBPACKAGES

ROOT = Path(__file__).resolve().parents[1]


def tracked_files() -> list[str]:
    done = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip("not a git checkout: cannot tell the tracked files")
    return [f for f in done.stdout.splitlines() if (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in tracked_files():
        if name.startswith(("tests/", "docs/")):
            continue
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    build = ("import sys; from setuptools import build_meta as b; "
             "print(b.build_wheel(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-c", build, str(out)], cwd=src, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


def test_wheel_has_one_top_level_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"omniscale", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    assert "omniscale/__init__.py" in names and "omniscale/__main__.py" in names


def test_every_package_folder_is_in_the_wheel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    folders = sorted(str(p.parent.relative_to(ROOT)) for sub in SUBPACKAGES
                     for p in (ROOT / sub).rglob("__init__.py"))
    assert len(folders) >= len(SUBPACKAGES)
    missing = [f for f in folders if f"omniscale/{f}/__init__.py" not in names]
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"
    modules = [str(p.relative_to(ROOT)) for f in folders for p in (ROOT / f).glob("*.py")]
    assert not [m for m in modules if f"omniscale/{m}" not in names]


def test_console_script_points_into_omniscale(wheel):
    archive = zipfile.ZipFile(wheel)
    entry = next(n for n in archive.namelist() if n.endswith("entry_points.txt"))
    assert "omniscale = omniscale.tools.cli:main" in archive.read(entry).decode()


def test_unpacked_wheel_imports_without_the_checkout(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    probe = ("import omniscale.dataplane, omniscale.tools.cli, omniscale.kernels as k, sys; "
             "print(omniscale.dataplane.__file__); print(k.get('rms_norm').__module__); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('dataplane', 'tools', 'kernels', 'parallel', 'loaders')))")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    where, kernel_module, bare = done.stdout.strip().splitlines()
    assert Path(where).is_relative_to(tmp_path / "site")
    assert kernel_module.startswith("omniscale.kernels.")
    assert bare == "[]"


def _bare_import_from_the_root(name: str, pythonpath: str = "") -> str:
    """Where ``import name`` lands when run from the checkout's root (root first on sys.path,
    as under ``python -m`` or pytest)."""
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else dict(os.environ)
    done = subprocess.run([sys.executable, "-c", f"import {name}; print({name}.__file__)"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_an_installed_package_named_like_kernels_is_not_hidden_by_the_checkout(tmp_path):
    """transformers >= 5.25 imports Hugging Face's `kernels`; run from the checkout it found
    our `kernels/` first and failed (`cannot import name 'CUDAProperties'`). A stand-in
    installed package: the bare name must reach it, and `omniscale.kernels` stay ours."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("FROM_THE_HUB = True\n")
    landed = _bare_import_from_the_root("kernels", pythonpath=str(site))
    assert Path(landed).is_relative_to(site), landed
    ours = _bare_import_from_the_root("omniscale.kernels", pythonpath=str(site))
    assert Path(ours).is_relative_to(ROOT / "kernels"), ours


def test_no_folder_hides_an_installed_package_of_its_name():
    """Any installed distribution that provides one of our folder names as a top-level
    package must still be what the bare name imports from the checkout (a folder that
    collides needs ``omniscale.hand_over_top_level`` in its ``__init__``, as kernels/ has)."""
    from importlib.metadata import packages_distributions

    provided = packages_distributions()
    for name in SUBPACKAGES:
        others = [d for d in provided.get(name, []) if d.lower() != "omniscale"]
        if others:
            landed = Path(_bare_import_from_the_root(name))
            assert not landed.is_relative_to(ROOT / name), (
                f"{name}/ hides the installed {others}: import it under its bare name from "
                f"the checkout and you get ours ({landed})")
