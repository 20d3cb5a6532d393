"""How the tests of a mutant run, for ``tools/bench/mutation.py``: a new ``python -m pytest``
per run (:func:`runner_in`), or a child forked from a server that imported torch and the rest
once (:class:`ForkRunner`, the default). Either runner is called as
``runner(tests, deselect, timeout, coverage=None) -> Outcome``; with ``coverage`` (a data file
and the one source file to measure) the run records which test executed which line, one
coverage context per test (``tools/bench/mutation_plugin.py`` switches them).

The fork runner's server loads this file by path and must import nothing of the project: only
the standard library and pytest here."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import importlib.metadata
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

PLUGIN = "omniscale.tools.bench.mutation_plugin"  # loaded into each test run (`-p`)


@dataclasses.dataclass(frozen=True)
class Coverage:
    """Where a run's coverage data goes, and the one file it measures (absolute)."""

    data_file: str
    source: str


@dataclasses.dataclass
class Outcome:
    status: str  # "killed", "survived", "timed_out", "crashed" (a signal ended the run) or
    # "error" (pytest could not run them)
    seconds: float
    tail: str = ""  # the end of pytest's output
    code: int | None = None  # pytest's exit code (minus the signal that ended it); None: timed out


# pytest's exit codes: 0 all passed, 1 a test failed, 2 interrupted (a collection error: the
# mutated module does not import); 3-5 mean the run itself is broken (internal error, usage,
# no tests), which says nothing about the mutant -- but for the two usage errors (4) that are
# a module that does not import: a conftest.py that imports it (the loaders' and the
# balancer's import the demo's builder), and a test given by node id (`file::test`) in a file
# that imports it. The same tests passed the baseline, so it is the mutant.
_KILLED_CODES = (1, 2)
_NOT_IMPORTED = ("ImportError while loading conftest",  # pytest's first line then
                 "ERROR: found no collectors for")  # its last
_TAIL = 2000  # characters of pytest's output kept
_HEAD = 500  # and of its start


def _outcome(code: int, seconds: float, output: str) -> Outcome:
    """What pytest's exit code and its output (all of it, or its head and tail) say."""
    killed = code in _KILLED_CODES or (code == pytest.ExitCode.USAGE_ERROR
                                       and any(line in output for line in _NOT_IMPORTED))
    # a run that a signal ended (numba's unchecked indexing: a segfault) broke on the mutant:
    # the same tests passed on the module as it is
    status = "survived" if code == 0 else "killed" if killed else \
        "crashed" if code < 0 else "error"
    return Outcome(status, seconds, output[-_TAIL:], code)


def _pytest_args(tests: tuple[str, ...], deselect: tuple[str, ...]) -> list[str]:
    """Stop at the first failure; no cache written into the copy; the demo handed over."""
    return ["-x", "-q", "-p", "no:cacheprovider", "-p", PLUGIN, *tests,
            *(f"--deselect={d}" for d in deselect)]


def runner_in(work: Path, env: dict[str, str]) -> Callable[..., Outcome]:
    """The subprocess runner (``--runner subprocess``): a new ``python -m pytest`` per run in
    ``work``, niced (the machine is shared); a timeout kills the whole process group."""

    def run(tests: tuple[str, ...], deselect: tuple[str, ...], timeout: float,
            coverage: Coverage | None = None) -> Outcome:
        measure = [] if coverage is None else [
            "-m", "coverage", "run", f"--data-file={coverage.data_file}",
            f"--include={coverage.source}"]
        command = [sys.executable, *measure, "-m", "pytest", *_pytest_args(tests, deselect)]
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: os.nice(10))
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            return Outcome("timed_out", time.perf_counter() - start)
        finally:  # also on Ctrl-C: no test run outlives the driver
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        return _outcome(proc.returncode, time.perf_counter() - start,
                        out.decode(errors="replace"))
    return run


# What the mapped tests import that is neither `omniscale` nor `tests`, the seconds each took in
# `-X importtime` of a collection of every file of MODULE_TESTS on the 2-core machine: torch 2.1
# and its distributed checkpoint 0.5, pandas 0.3 (the plane's wire), numba 0.2, transformers 0.2
# (the chat tests), numpy, pyarrow, pydantic, av, ... Hypothesis is imported by its pytest plugin,
# which the server imports with the others pytest would load (their entry points): a fresh pytest
# rewrites the asserts of every module of a plugin's package, hypothesis' 1.1 s of a trivial run.
# No Python thread may run in the server when it forks (checked). Two native ones do: OpenBLAS'
# pool (numpy), which its own fork handler stops first, and jemalloc's background thread
# (pyarrow), whose locks jemalloc's fork handler takes, so no child inherits one held.
PRELOAD = ("numpy", "torch", "torch.distributed.checkpoint", "pyarrow", "pyarrow.compute",
           "pyarrow.parquet", "pyarrow.flight", "pandas", "numba", "hypothesis", "pydantic",
           "fsspec", "filelock", "rich.console", "rich.progress", "av", "PIL.Image",
           "PIL.ImageDraw", "tokenizers", "soundfile", "transformers", "coverage")

# Started by `python -c` so that no checkout folder lands on sys.path: the server loads this file
# by path, under a name of its own, and imports nothing of the project.
_SERVER = ("import importlib.util, sys; "
           "spec = importlib.util.spec_from_file_location('mutation_server', sys.argv[1]); "
           "module = importlib.util.module_from_spec(spec); sys.modules[spec.name] = module; "
           "spec.loader.exec_module(module); module.serve(sys.argv[2:])")


class ForkRunner:
    """The fork runner (the default): one server process per module run imports the heavy
    third-party modules once (:data:`PRELOAD`), then forks a child per test run that calls
    ``pytest.main`` in ``work`` and exits with its code. ``omniscale`` and ``tests`` are never
    imported in the server (it refuses to start if they are), so each child imports them from
    the copy as it is at that run, mutated. A timeout kills the child's process group; so does
    Ctrl-C here, and the child's group is killed when it exits too, taking what it started.

    Apart from start-up, a child differs from ``python -m pytest`` in what a fork shares: the
    string-hash seed of the server (set iteration orders are the same in every child).
    Python's ``random`` reseeds itself in a child, Hypothesis draws its seed in the child, and
    numpy's global generator is reseeded there. A child ends with ``os._exit``: no ``atexit``
    handler runs, and what the tests left running dies with its process group."""

    def __init__(self, work: Path, env: dict[str, str], preload: tuple[str, ...] = PRELOAD,
                 start_timeout: float = 600):
        started = time.perf_counter()
        self._server = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(Path(__file__).resolve()), *preload], cwd=work,
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
            preexec_fn=lambda: os.nice(10))  # its children inherit the niceness
        self._buffer = b""
        try:
            ready = self._receive(start_timeout)
        except BaseException:
            self.close()
            raise
        self.server_pid: int = ready["pid"]
        self.start_seconds = time.perf_counter() - started

    def __call__(self, tests: tuple[str, ...], deselect: tuple[str, ...], timeout: float,
                 coverage: Coverage | None = None) -> Outcome:
        start = time.perf_counter()
        request = {"args": _pytest_args(tests, deselect),
                   "coverage": None if coverage is None else dataclasses.asdict(coverage)}
        self._server.stdin.write(json.dumps(request).encode() + b"\n")
        self._server.stdin.flush()
        child = self._receive(60)["pid"]
        try:
            done = self._receive(timeout)
        except TimeoutError:
            self._kill(child)
            self._receive(60)  # the server has reaped it
            return Outcome("timed_out", time.perf_counter() - start)
        except BaseException:  # Ctrl-C, a server that died: no test run outlives the driver
            self._kill(child)
            raise
        return _outcome(done["code"], time.perf_counter() - start, done["output"])

    def close(self) -> None:
        """Stops the server: its stdin closed, it exits; killed if it does not."""
        with contextlib.suppress(OSError):
            self._server.stdin.close()
        try:
            self._server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()

    def __enter__(self) -> ForkRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _kill(child: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child, signal.SIGKILL)

    def _receive(self, timeout: float) -> dict:
        """The server's next line, as JSON; TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        out = self._server.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([out], [], [], remaining)[0]:
                raise TimeoutError
            chunk = os.read(out, 1 << 16)
            if not chunk:
                raise RuntimeError(f"the fork runner's server exited "
                                   f"({self._server.wait()}); its error is above")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)


def serve(preload: list[str]) -> None:
    """The fork runner's server, in its own process (:class:`ForkRunner` starts it with the
    work copy as its directory): requests on stdin, one JSON line each, ``{"args": [...],
    "coverage": null or {"data_file": ..., "source": ...}}``;
    answers on stdout: ``{"pid": child}`` at once, ``{"code": ..., "output": ...}`` (pytest's
    output, its head and tail if long) when the child has exited."""
    sys.path[0] = os.getcwd()  # as `python -m pytest` has it (`-c` put "" there)
    for name in preload:
        with contextlib.suppress(ModuleNotFoundError):  # an extra this install lacks
            importlib.import_module(name)
    if not os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        for plugin in importlib.metadata.entry_points(group="pytest11"):
            importlib.import_module(plugin.module)
    _check_nothing_of_the_copy_imported(Path.cwd())
    # The collector then skips all the server's objects: pytest's gc.collect() at its end took
    # 0.4 s of a trivial run over torch's heap, and a child copies no page to count references.
    gc.freeze()
    answers = sys.stdout

    def answer(**fields) -> None:
        answers.write(json.dumps(fields) + "\n")
        answers.flush()  # also: nothing buffered for a child to inherit and write again

    answer(pid=os.getpid())
    for line in sys.stdin:
        if threading.active_count() > 1:  # a lock another thread held would stay held
            raise RuntimeError(f"a thread started in the server: {threading.enumerate()}")
        with tempfile.TemporaryFile() as output:
            child = os.fork()
            if child == 0:
                request = json.loads(line)
                _run_child(request["args"], output.fileno(), request.get("coverage"))
            with contextlib.suppress(OSError):  # its group, before the driver can kill it
                os.setpgid(child, child)
            answer(pid=child)
            _, status = os.waitpid(child, 0)
            with contextlib.suppress(ProcessLookupError):  # what it started and left behind
                os.killpg(child, signal.SIGKILL)
            size = os.fstat(output.fileno()).st_size
            output.seek(0)
            head = output.read(_HEAD)
            output.seek(max(size - 4 * _TAIL, len(head)))  # bytes: a character may be 4
            text = (head + b"\n...\n" * (output.tell() > len(head)) + output.read()).decode(
                errors="replace")
        answer(code=os.waitstatus_to_exitcode(status), output=text)


def _check_nothing_of_the_copy_imported(work: Path) -> None:
    """The server imported nothing of the project: a module imported here would be the
    unmutated one in every child."""
    def in_work(module) -> bool:
        file = getattr(module, "__file__", None)  # torch.ops': a name, not a path
        return isinstance(file, str) and os.path.isabs(file) and \
            Path(file).resolve().is_relative_to(work)

    work = work.resolve()
    loaded = sorted(name for name, module in list(sys.modules.items())
                    if name.partition(".")[0] in ("omniscale", "tests") or in_work(module))
    if loaded:
        raise RuntimeError(f"the server imported the project's modules: {loaded[:10]}")


def _run_child(args: list[str], output: int, coverage: dict | None = None) -> None:
    """A forked child: pytest on ``args`` in its own process group, its output into
    ``output``; never returns (``os._exit`` with pytest's exit code, 70 if it broke first)."""
    code = 70
    try:
        os.setpgid(0, 0)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        sys.argv = [str(Path(pytest.__file__).with_name("__main__.py")), *args]
        if "numpy.random" in sys.modules:  # numpy does not reseed at a fork, as Python does
            sys.modules["numpy.random"].seed()
        measured = None
        if coverage is not None:  # before pytest imports the project: import-time lines too
            import coverage as coverage_py

            measured = coverage_py.Coverage(data_file=coverage["data_file"],
                                            include=[coverage["source"]])
            measured.start()
        # the plugins were imported before pytest could rewrite their asserts: it warns, once
        # per plugin, in every run's output
        code = int(pytest.main(["-W", "ignore::pytest.PytestAssertRewriteWarning", *args]))
        if measured is not None:  # os._exit below runs no atexit handler: saved here
            measured.stop()
            measured.save()
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


