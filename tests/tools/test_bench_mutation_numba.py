"""The mutation run's per-kernel numba cache (tools/bench/mutation_numba.py): a kernel's stamp
changes with everything its compiled code can depend on and with nothing else, and a real
numba run with the locator never serves a kernel compiled from older source."""

import os
import subprocess
import sys
from pathlib import Path

from omniscale.tools.bench.mutation_numba import LOCATOR_ENV, kernel_stamp

REPO = Path(__file__).resolve().parents[2]

KERNELS = '''\
import numpy as np
from numba import njit

from .helper import offset

SCALE = 2


@njit(cache=True)
def inner(x):
    return x * SCALE


@njit(cache=True)
def outer(x):
    return inner(x) + offset(x)


@njit(cache=True)
def alone(x):
    return x - 1


def plain(x):
    return outer(x) - 1
'''

HELPER = '''\
from numba import njit


@njit(cache=True)
def offset(x):
    return 1
'''


def _package(tmp_path: Path, kernels: str = KERNELS, helper: str = HELPER) -> Path:
    package = tmp_path / "pkg"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "kern.py").write_text(kernels)
    (package / "helper.py").write_text(helper)
    return package / "kern.py"


def _stamps(path: Path) -> dict[str, str]:
    return {name: kernel_stamp(str(path), name) for name in ("inner", "outer", "alone")}


def test_a_kernels_stamp_follows_its_own_code_its_callees_constants_and_imports_only(tmp_path):
    path = _package(tmp_path)
    before = _stamps(path)
    assert len(set(before.values())) == 3

    _package(tmp_path, KERNELS.replace("return outer(x) - 1", "return outer(x) + 1"))
    assert _stamps(path) == before  # plain Python: no kernel can call it

    _package(tmp_path, KERNELS.replace("x * SCALE", "x + SCALE"))
    after = _stamps(path)  # a callee: its callers' cached code holds it
    assert after["inner"] != before["inner"] and after["outer"] != before["outer"]
    assert after["alone"] == before["alone"]

    _package(tmp_path, KERNELS.replace("inner(x) + offset", "inner(x) - offset"))
    after = _stamps(path)
    assert after["outer"] != before["outer"]
    assert (after["inner"], after["alone"]) == (before["inner"], before["alone"])

    _package(tmp_path, KERNELS.replace("SCALE = 2", "SCALE = 3"))  # frozen into the code
    assert all(_stamps(path)[k] != before[k] for k in before)

    _package(tmp_path, helper=HELPER.replace("return 1", "return 2"))  # an imported kernel
    assert all(_stamps(path)[k] != before[k] for k in before)


def test_a_name_that_is_no_top_level_kernel_gets_the_whole_files_stamp(tmp_path):
    path = _package(tmp_path)
    whole = kernel_stamp(str(path), "plain")
    assert whole == kernel_stamp(str(path), "missing") != kernel_stamp(str(path), "inner")
    _package(tmp_path, KERNELS.replace("return outer(x) - 1", "return outer(x) + 1"))
    assert kernel_stamp(str(path), "plain") != whole


def _outer_of_3(tmp_path: Path, locator: bool) -> tuple[int, int]:
    """outer(3) in a new process, and how many of its kernels numba compiled (found no cached
    code for)."""
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}",
           "NUMBA_CACHE_DIR": ""}
    env.pop("NUMBA_CACHE_LOCATOR_CLASSES", None)
    if locator:
        env.update(LOCATOR_ENV)
    script = ("from pkg.kern import outer; from pkg.helper import offset; print(outer(3), "
              "sum(sum(k.stats.cache_misses.values()) for k in (outer, offset)))")
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    value, compiled = done.stdout.split()
    return int(value), int(compiled)


def test_a_changed_callee_is_compiled_again_and_the_original_comes_back_from_the_cache(
        tmp_path):
    path = _package(tmp_path)
    kernels_dir = path.parent / "__pycache__" / "kernels"
    assert _outer_of_3(tmp_path, locator=True) == (3 * 2 + 1, 2)
    assert len(list(kernels_dir.iterdir())) == 4  # a folder per stamp (helper.offset too)

    _package(tmp_path, KERNELS.replace("x * SCALE", "x * SCALE * 10"))
    # the oracle: numba's own locator, whose stamp is the whole file
    assert _outer_of_3(tmp_path, locator=True)[0] == _outer_of_3(tmp_path, locator=False)[0] \
        == 3 * 2 * 10 + 1
    assert len(list(kernels_dir.iterdir())) == 6  # the changed inner's and outer's beside them

    _package(tmp_path, KERNELS.replace("- 1", "- 2"))  # alone and plain changed, not outer
    assert _outer_of_3(tmp_path, locator=True) == (7, 0)  # outer (inner in it) loaded
