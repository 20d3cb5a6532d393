"""What tools/bench/gpu_check.sh needs importable on the GPU machine, and what travels there
prepared (``gpu_wheels/``, written here by ``bash tools/bench/gpu_check.sh --prepare``; that
machine reaches no package index).

The GPU image is not this project's environment: its own ``python3`` with torch 2.11, Triton
3.6, transformers and much else, but not every runtime dependency in pyproject.toml. Which ones
it lacks is checked there, at run time, by importing them (``missing``); only the wheels of the
missing ones (and their dependencies in the folder) are installed, into a directory of their
own that goes on ``PYTHONPATH``. What this module ships is what the GPU stages import and the
image is not known to hold (the device docs' package list of the 'cuda' image, read 2026-11):
pydantic, with its dependencies. The big ones cannot travel at all (the working tree and
everything carried with it must fit in 64 MiB): pyarrow (~42 MB) and numba + llvmlite
(~46 MB) are in that image; av (34 MB), decord, ray, soundfile and s3fs are not, and no GPU
stage needs them (the trainer run is the ``lm`` task on text carried in the folder: no media).

Standard library only (``lm-data`` and ``manifest`` aside, which run here with the project's
environment): the rest runs on the bare image before anything is installed.

    python tools/bench/_gpu_deps.py shipped [--pinned]    # what --prepare downloads
    python tools/bench/_gpu_deps.py prune WHEELS          # drop downloaded NOT_CARRIED wheels
    python tools/bench/_gpu_deps.py check WHEELS          # the folder holds every shipped wheel
    python tools/bench/_gpu_deps.py lm-data DEST          # the trainer run's text data
    python tools/bench/_gpu_deps.py manifest WHEELS PYVER # WHEELS/prepared.json, sizes
    python tools/bench/_gpu_deps.py missing               # required imports that fail here
    python tools/bench/_gpu_deps.py install WHEELS TARGET # the missing ones' wheels -> TARGET
    python tools/bench/_gpu_deps.py verify [--json F]     # every required module imports
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

# Every third-party module the GPU stages import (module -> distribution), and who needs it:
# the top-level modules a CPU rehearsal of every stage loaded with the image's packages alone.
REQUIRED = {
    "torch": "torch", "triton": "triton", "numpy": "numpy",
    "yaml": "pyyaml",  # configs, specs
    "pydantic": "pydantic",  # tools/train/config.py, dataplane/spec.py
    "pyarrow": "pyarrow",  # the source index, the plane's Arrow Flight
    "numba": "numba",  # balancer/
    "rich": "rich",  # progress, tables
    "fsspec": "fsspec",  # loaders/readers.py
    "tokenizers": "tokenizers", "safetensors": "safetensors", "filelock": "filelock",
    "tensorboard": "tensorboard",  # the trainer's metrics sink
    "transformers": "transformers",  # tools/bench/_hf_step.py
    "pytest": "pytest", "hypothesis": "hypothesis",  # the `gpu` tests (tests/conftest.py)
}
# What --prepare downloads (with their dependencies, less NOT_CARRIED).
SHIPPED = ("pydantic",)
# Dependencies a download may pull in that stay behind: the image has them, and several are
# far too big to travel (torch and the nvidia-* libraries are GBs).
NOT_CARRIED = {"torch", "triton", "numpy", "transformers", "tokenizers", "safetensors",
               "huggingface-hub", "pyyaml", "filelock", "jinja2", "markupsafe", "fsspec",
               "pyarrow", "numba", "llvmlite", "pillow", "setuptools", "sympy", "networkx"}
NOT_CARRIED_PREFIXES = ("nvidia-", "cuda-")


def norm(name: str) -> str:
    """A distribution's canonical name (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def carried(dist: str) -> bool:
    dist = norm(dist)
    return dist not in NOT_CARRIED and not dist.startswith(NOT_CARRIED_PREFIXES)


def wheels_in(folder: Path) -> dict[str, Path]:
    """{distribution: wheel file} of the folder (one version each: --prepare's)."""
    return {norm(w.name.split("-")[0]): w for w in sorted(Path(folder).glob("*.whl"))}


def requires(wheel: Path) -> list[str]:
    """The distributions a wheel depends on, extras and markers aside (a marker's dependency
    is kept: installing one too many small wheels costs nothing)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    deps = []
    for line in lines:
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            deps.append(norm(re.match(r"[A-Za-z0-9._-]+", line.split(":", 1)[1].strip())[0]))
    return deps


def closure(dists, folder: Path) -> tuple[list[Path], list[str]]:
    """The wheels that install ``dists`` from ``folder``, dependencies found there included,
    and the dists that have no wheel there (a dependency absent from the folder is left to the
    image: verify() finds out)."""
    have = wheels_in(folder)
    chosen: dict[str, Path] = {}
    absent, todo = [], [norm(d) for d in dists]
    while todo:
        dist = todo.pop()
        if dist in chosen:
            continue
        if dist not in have:
            absent.append(dist)
            continue
        chosen[dist] = have[dist]
        todo += [d for d in requires(have[dist]) if d in have]
    return sorted(chosen.values()), sorted(set(absent))


def importable(modules) -> dict[str, str | None]:
    """{module: None if it imports, else the error in one line}."""
    errors = {}
    for module in modules:
        try:
            importlib.import_module(module)
            errors[module] = None
        except Exception as e:  # a broken install (ABI, missing .so) counts as missing
            errors[module] = f"{type(e).__name__}: {e}".splitlines()[0]
    return errors


def missing() -> list[str]:
    """The required distributions whose module does not import in this interpreter."""
    return sorted({REQUIRED[m] for m, err in importable(REQUIRED).items() if err})


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def install(folder: Path, target: Path, python: str = sys.executable) -> int:
    """pip-install (no index, no resolver: the folder's own closure) the wheels of what is
    missing here into ``target``; 1 with one line per missing distribution that has no wheel."""
    need = missing()
    if not need:
        print("gpu_deps: every required module imports; nothing to install")
        return 0
    files, absent = closure(need, folder)
    if absent:
        print(f"gpu_deps: missing here and not in {folder}: {', '.join(absent)} (imports: "
              f"{', '.join(m for m, d in REQUIRED.items() if d in absent)})", file=sys.stderr)
    if files:
        print(f"gpu_deps: installing {', '.join(f.name for f in files)} into {target}")
        cmd = [python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
               "--no-compile", "--disable-pip-version-check", "--root-user-action=ignore",
               "--upgrade", "--target", str(target), *map(str, files)]
        if subprocess.run(cmd).returncode:
            return 1
    return 1 if absent else 0


def check(folder: Path) -> list[str]:
    """Problems with a wheel folder: a shipped distribution without its wheel, a dependency
    of a shipped wheel that is neither there nor left to the image, or two versions of one."""
    problems = []
    names = [norm(w.name.split("-")[0]) for w in Path(folder).glob("*.whl")]
    problems += [f"two wheels of {d}" for d in sorted({d for d in names if names.count(d) > 1})]
    files, absent = closure(SHIPPED, folder)
    problems += [f"no wheel of {d} (shipped: --prepare downloads it)" for d in absent]
    have = wheels_in(folder)
    for wheel in files:
        for dep in requires(wheel):
            if dep not in have and carried(dep):
                problems.append(f"{wheel.name} needs {dep}: no wheel, and not one the image has")
    for dist in SHIPPED:  # the versions tested here (--prepare pins them)
        wheel, here = have.get(norm(dist)), version(dist)
        if wheel is not None and here is not None and wheel.name.split("-")[1] != here:
            problems.append(f"{wheel.name}: {dist} is {here} here (stale: run "
                            f"bash tools/bench/gpu_check.sh --prepare again)")
    return problems


def lm_data(dest: Path) -> None:
    """The trainer run's data: the demo's text sources alone (64 Python files of this
    interpreter's standard library and the pydoc topics, tools/demo's own builder and tokenizer),
    ``dest/lm.yaml`` its lm spec. The demo's CLI writes every modality (its media need av)."""
    from omniscale.tools.demo.dataset import Plan, build

    dest.mkdir(parents=True)
    build(dest, Plan({("train", "text"): 64}, {"train": 32}), seed=0, workers=1,
          scale="gpu_lm")


def manifest(folder: Path, py_version: str) -> dict:
    """``folder/prepared.json``: the commit it was prepared at, the wheels and the sizes."""
    from omniscale.tools.bench.provenance import provenance

    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != "prepared.json"}
    wheels = {k: v for k, v in files.items() if k.endswith(".whl")}
    info = {**provenance(), "python_version": py_version,
            "shipped": [f"{d}=={version(d)}" for d in SHIPPED], "wheels": wheels,
            "wheel_bytes": sum(wheels.values()),
            "lm_data_bytes": sum(v for k, v in files.items() if k.startswith("lm_data/")),
            "total_bytes": sum(files.values())}
    (folder / "prepared.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    shipped = sub.add_parser("shipped", help="the distributions --prepare downloads")
    shipped.add_argument("--pinned", action="store_true",
                         help="NAME==VERSION as installed here (the versions tested here)")
    sub.add_parser("missing", help="required distributions whose module does not import here")
    prune = sub.add_parser("prune", help="delete the folder's wheels of NOT_CARRIED dists")
    prune.add_argument("wheels", type=Path)
    data = sub.add_parser("lm-data", help="the trainer run's text data into DEST (new)")
    data.add_argument("dest", type=Path)
    man = sub.add_parser("manifest", help="WHEELS/prepared.json: commit, wheels, sizes")
    man.add_argument("wheels", type=Path)
    man.add_argument("py_version")
    inst = sub.add_parser("install", help="install the missing ones' wheels into TARGET")
    inst.add_argument("wheels", type=Path)
    inst.add_argument("target", type=Path)
    chk = sub.add_parser("check", help="the folder holds every shipped wheel and dependency")
    chk.add_argument("wheels", type=Path)
    ver = sub.add_parser("verify", help="import every required module; versions as JSON")
    ver.add_argument("--json", type=Path, help="write {module: version or error} here")
    args = ap.parse_args(argv)
    if args.cmd == "shipped":
        for dist in SHIPPED:
            pin = version(dist) if args.pinned else None
            print(f"{dist}=={pin}" if pin else dist)
    elif args.cmd == "missing":
        print("\n".join(missing()))
    elif args.cmd == "prune":
        for dist, wheel in wheels_in(args.wheels).items():
            if not carried(dist):
                wheel.unlink()
                print(f"gpu_deps: left out {wheel.name} (the image has {dist})")
    elif args.cmd == "lm-data":
        lm_data(args.dest)
    elif args.cmd == "manifest":
        info = manifest(args.wheels, args.py_version)
        for name, size in info["wheels"].items():
            print(f"{size / 2**20:8.2f} MiB  {name}")
        print(f"{info['wheel_bytes'] / 2**20:8.2f} MiB  wheels\n"
              f"{info['lm_data_bytes'] / 2**20:8.2f} MiB  lm_data/\n"
              f"{info['total_bytes'] / 2**20:8.2f} MiB  {args.wheels}/ in all (carried to the "
              f"GPU machine with the working tree: 64 MiB together)")
    elif args.cmd == "install":
        return install(args.wheels, args.target)
    elif args.cmd == "check":
        problems = check(args.wheels)
        for p in problems:
            print(f"gpu_deps: {args.wheels}: {p}", file=sys.stderr)
        if not problems:
            files = sorted(Path(args.wheels).glob("*.whl"))
            size = sum(f.stat().st_size for f in files)
            print(f"gpu_deps: {args.wheels}: {len(files)} wheels, {size / 2**20:.1f} MiB, "
                  f"every shipped distribution and its dependencies there")
        return 1 if problems else 0
    elif args.cmd == "verify":
        errors = importable(REQUIRED)
        report = {m: err if err else version(REQUIRED[m]) or "?" for m, err in errors.items()}
        if args.json:
            args.json.write_text(json.dumps({"imports": report,
                                             "failed": sorted(m for m, e in errors.items() if e),
                                             "python": sys.version.split()[0],
                                             "executable": sys.executable}, indent=1) + "\n")
        bad = {m: e for m, e in errors.items() if e}
        for m, e in bad.items():
            print(f"gpu_deps: import {m} ({REQUIRED[m]}): {e}", file=sys.stderr)
        print(f"gpu_deps: {len(errors) - len(bad)}/{len(errors)} required modules import")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
