"""Numba's on-disk cache, kept per kernel during a mutation run (``tools/bench/mutation.py``).

Numba stamps a cached kernel with its whole source file: a mutant anywhere in ``pack.py``
recompiles every kernel of it, 15-20 s per mutant (most of pack's and assign's run time). Here
a kernel's stamp is what its compiled code can depend on: its own source, that of the
kernels of the same file it calls (directly or through others: a caller's cached code holds
its callees'), the file's module-level statements (constants numba freezes into the code) and
the whole text of each project module the file imports (a kernel called from there). A mutant
then recompiles only the kernels it can change; a mutant in plain Python code none.

Each stamp gets its own cache folder, so the unmutated kernels' cache survives every mutant.
The mutation run selects this locator with numba's ``NUMBA_CACHE_LOCATOR_CLASSES``
(:data:`LOCATOR_ENV`); nothing else uses it.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os

from numba.core.caching import _CacheLocator, _SourceFileBackedLocatorMixin

LOCATOR_ENV = {"NUMBA_CACHE_LOCATOR_CLASSES":
               "omniscale.tools.bench.mutation_numba.KernelSourceLocator"}


def _is_kernel(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef) and any(
        "jit" in ast.unparse(d) for d in node.decorator_list)


def _segment(lines: list[str], node: ast.AST) -> str:
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
    return "".join(lines[first - 1:node.end_lineno])


def _project_file(module: str, level: int, py_file: str) -> str | None:
    """The file of a project module the kernels' file imports (``omniscale.*`` or relative);
    None for others (their code does not change during a run)."""
    if level:
        package = os.path.dirname(py_file)
        for _ in range(level - 1):
            package = os.path.dirname(package)
        candidate = os.path.join(package, *module.split(".")) + ".py" if module else None
        return candidate if candidate and os.path.isfile(candidate) else None
    if not module.startswith("omniscale"):
        return None
    spec = importlib.util.find_spec(module)
    return spec.origin if spec is not None and spec.origin else None


def _stamps(py_file: str, source: str) -> dict[str, str]:
    """Each kernel of ``source`` (the text of ``py_file``) by name -> its stamp."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    kernels = {n.name: n for n in tree.body if _is_kernel(n)}
    shared = hashlib.sha256()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue  # plain Python: kernels cannot call it
        shared.update(_segment(lines, node).encode())
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""]
            for name in names:
                path = _project_file(name, getattr(node, "level", 0), py_file)
                if path is not None:
                    with open(path, "rb") as f:
                        shared.update(f.read())
    calls = {name: {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & kernels.keys()
             for name, node in kernels.items()}
    stamps = {}
    for name in kernels:
        reached, todo = {name}, [name]
        while todo:
            for callee in calls[todo.pop()] - reached:
                reached.add(callee)
                todo.append(callee)
        digest = shared.copy()
        for callee in sorted(reached):
            digest.update(_segment(lines, kernels[callee]).encode())
        stamps[name] = digest.hexdigest()
    return stamps


def kernel_stamp(py_file: str, name: str) -> str:
    """The stamp of kernel ``name`` defined at the top of ``py_file``; for anything else the
    whole file's hash, as numba's own locators have it."""
    with open(py_file, encoding="utf-8") as f:
        source = f.read()
    stamp = _stamps(py_file, source).get(name)
    return stamp or hashlib.sha256(source.encode()).hexdigest()


class KernelSourceLocator(_SourceFileBackedLocatorMixin, _CacheLocator):
    """Numba's in-tree locator (``__pycache__`` beside the file) with a kernel's own stamp."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._stamp = kernel_stamp(py_file, py_func.__name__)
        self._cache_path = os.path.join(os.path.dirname(py_file), "__pycache__",
                                        "kernels", self._stamp[:24])

    def get_cache_path(self):
        return self._cache_path

    def get_source_stamp(self):
        return self._stamp
