"""Which of a module's tests execute the lines a mutant changes (``tools/bench/mutation.py``'s
``--select covering``, the default): the module's fast tests run once under coverage, one
context per test (``mutation_plugin.py``), and each mutant then runs only the tests that
execute its statement, in the order they ran. A mutant no test executes cannot fail one; most
of a module run's time went to survivors running every test.

Every fast test runs for a mutant whose effect can reach tests that never execute its line:
a statement outside any function (run once, at import, and read by every later test), one in a
function compiled by numba (coverage cannot see inside), lines run outside any single test
(collection, a fixture shared by several tests) and lines no test ran, in its own process or
in one it started (a process that ends without Python's exit handlers, killed or forked,
saves no data). What selection can still miss, and
``--select all`` would not: a value one test computes with the line and caches for a later test
in the same process."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from omniscale.tools.bench.mutation_plugin import OUTSIDE_TESTS, SUBPROCESS_DATA, hang_timeout

COMPILED = ("jit",)  # decorators whose functions coverage cannot look into (numba's njit, jit)


@dataclasses.dataclass(frozen=True)
class LineTests:
    """One coverage-measured run of a module's tests: the node ids that executed each line,
    every test in the order it ran, and the seconds each took (under coverage: slower than
    without)."""

    by_line: dict[int, frozenset[str]]
    order: tuple[str, ...]
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def read(cls, data_file: Path, source: Path) -> LineTests:
        from coverage import CoverageData

        by_line: dict[int, frozenset[str]] = {}
        for path in (data_file, *data_files_of_subprocesses(data_file)):
            data = CoverageData(basename=str(path))
            data.read()
            measured = {str(Path(f).resolve()): f for f in data.measured_files()}
            if (name := measured.get(str(source.resolve()))) is not None:
                for line, contexts in data.contexts_by_lineno(name).items():
                    by_line[line] = by_line.get(line, frozenset()) | frozenset(contexts)
        order_file = Path(f"{data_file}.tests")
        order = order_file.read_text().split("\n")[:-1] if order_file.is_file() else []
        times_file = Path(f"{data_file}.seconds")
        seconds = {}
        if times_file.is_file():
            for line in times_file.read_text().splitlines():
                test, _, took = line.rpartition("\t")
                seconds[test] = seconds.get(test, 0.0) + float(took)
        return cls(by_line, tuple(dict.fromkeys(order)), seconds)

    def timeout_for(self, tests: tuple[str, ...], ceiling: float) -> float:
        """A timeout for running ``tests`` alone: three times their measured time, at least
        30 s more than it (collection, imports), at most ``ceiling`` (the whole set's)."""
        return min(ceiling, hang_timeout(sum(self.seconds.get(t, ceiling) for t in tests)))

    def tests_for(self, tree: ast.Module, line: int) -> tuple[tuple[str, ...] | None, str]:
        """The node ids to run against a mutant on ``line`` of the module parsed as ``tree``,
        in run order, or None for all of them; and why, in a few words."""
        lines, why_all = statement_site(tree, line)
        if why_all:
            return None, why_all
        contexts = frozenset().union(*(self.by_line.get(n, ()) for n in lines))
        if not contexts:
            return None, "no test ran it"
        if OUTSIDE_TESTS in contexts:
            return None, "run outside a single test"
        return tuple(t for t in self.order if t in contexts), "covering"


def data_files_of_subprocesses(data_file: Path) -> list[Path]:
    """The data files the measured run's Python subprocesses wrote (one each)."""
    return sorted(data_file.parent.glob(f"{data_file.name}{SUBPROCESS_DATA}.*"))


def statement_site(tree: ast.Module, line: int) -> tuple[frozenset[int], str]:
    """The lines of the innermost statement holding ``line`` (a compound statement's header
    only: ``if``, ``for``, ``def`` lines before its body) and, when every test must run, why:
    the statement runs at import, or inside a compiled function."""
    found: ast.stmt | None = None
    functions: tuple[ast.FunctionDef | ast.AsyncFunctionDef, ...] = ()

    def visit(node: ast.AST, enclosing: tuple) -> None:
        nonlocal found, functions
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                if child.lineno <= line <= child.end_lineno:
                    found, functions = child, enclosing
                    inner = enclosing + (child,) if isinstance(
                        child, (ast.FunctionDef, ast.AsyncFunctionDef)) else enclosing
                    visit(child, inner)
            else:  # an except handler, a match case: statements inside
                visit(child, enclosing)

    visit(tree, ())
    if found is None or not functions:
        return frozenset({line}), "runs at import"
    if any(name in ast.unparse(d) for f in functions for d in f.decorator_list
           for name in COMPILED):
        return frozenset({line}), "compiled"
    body = getattr(found, "body", None)
    last = body[0].lineno - 1 if isinstance(body, list) and body and isinstance(
        body[0], ast.stmt) else found.end_lineno
    return frozenset(range(found.lineno, max(found.lineno, last) + 1)) | {line}, ""
