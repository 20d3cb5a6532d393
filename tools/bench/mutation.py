"""Mutation testing of the modules that guard data and training (issue #46): do their tests
notice when the code is wrong?

    .venv/bin/python tools/bench/mutation.py --module tools/train/guard.py \
        --module dataplane/journal.py --out /tmp/mutation.json
    .venv/bin/python tools/bench/mutation.py --list   # the mapping and mutant counts, no run
    .venv/bin/python tools/bench/mutation.py --check  # each module's tests unmutated and with
                                                      # the canary, no mutant; the time of a run

The mutants are Cosmic Ray's (its operators: comparison, binary and unary operator swaps,
number changes, ``and``/``or``, ``not`` added, loops run zero times, ...); this driver picks
them, applies one at a time and runs pytest itself, because Cosmic Ray runs one test command
for every mutant and cannot sample. Each module is tested only with the tests that cover it
(:data:`MODULE_TESTS`, written by hand: the whole suite takes over 20 minutes); a module with
more than ``--max-mutants`` mutants gets a reproducible sample (``--seed``), spread over its
code sites before any site gets a second mutant.

The tests of a mutant run in a child forked from a process that imported torch, pyarrow,
Hypothesis and the rest of what they import from outside the project once per module
(:class:`ForkRunner`, 0.2 s of start-up instead of 5-9 s); ``--runner subprocess`` starts a new
``python -m pytest`` for each instead.

Everything runs in a copy of the repository's files (``--work``), never in the checkout: the
copy is put first on PYTHONPATH, so ``omniscale`` is imported from it, and each module's run
starts with a canary (the module raising on import) that its tests must fail, which proves
the tests exercise the copy. A mutated file is restored after its test run whatever happens
(Ctrl-C, SIGTERM) and checked against the original's SHA-256.

The suite's demo dataset (``demo_root``, about 12 s to build) is built once, from the
unmutated code, and handed to each test run by this module as a pytest plugin, unless the
mutated module is one that building the demo imports.

The JSON has per module the mutants generated, sampled, killed, survived, timed out, and each
survivor (line, operator, diff) with a ``reason`` to fill in by hand: empty means nobody has
looked; ``needs a test: ...`` a gap in the tests; anything else one line on why the mutant is
equivalent or acceptable. Reasons already written in ``--out`` are kept for the same mutation
of the same line text.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import gc
import hashlib
import importlib
import importlib.metadata
import json
import math
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN = "omniscale.tools.bench.mutation"  # this module, loaded into each test run
DEMO_ENV = "OMNISCALE_MUTATION_DEMO"  # the prebuilt demo's directory, for the plugin
CANARY = "\nraise RuntimeError('mutation canary: this module must not import')\n"


@dataclasses.dataclass(frozen=True)
class ModuleTests:
    """The tests run against each mutant of a module (pytest node ids: files or
    ``file::test``), and slower ones run only on the mutants those leave alive
    (``--recheck-slow``). A slow node id inside a fast file is deselected from the fast run."""

    fast: tuple[str, ...]
    slow: tuple[str, ...] = ()


_DURABILITY = "tests/dataplane/test_plane_durability.py"
_RANDOM_KILLS = (f"{_DURABILITY}::"
                 "test_random_kills_truncations_and_flips_never_lose_a_committed_step")
_MIXER_PROPERTIES = (  # Hypothesis over schedules: 24 s and 6 s
    "tests/dataplane/test_mixer.py::test_realized_mixture_tracks_the_target_within_one_sample",
    "tests/dataplane/test_mixer.py::test_restoring_a_state_mid_run_continues_identically")

# Each module of issue #46 -> the tests that exercise it directly (the files that import it, or
# the plane's for its internals), fastest first since a failure stops the run (-x). "slow":
# multi-process training runs and long property tests, over 5 s each in `--check`'s runs (a
# test that builds the demo takes 8 s more when the mutated module is one the demo is built
# with). records.py's flush is then left to its slow tests: only training runs call it.
MODULE_TESTS: dict[str, ModuleTests] = {
    "dataplane/journal.py": ModuleTests(
        ("tests/dataplane/test_group_commit.py", "tests/dataplane/test_corrupt.py",
         "tests/dataplane/test_restore_edges.py", _DURABILITY,
         "tests/dataplane/test_commit_many.py"),
        (_RANDOM_KILLS, "tests/dataplane/test_plane_faults.py")),
    "dataplane/restore.py": ModuleTests(
        ("tests/dataplane/test_restore_edges.py", _DURABILITY),
        (_RANDOM_KILLS, "tests/tools/test_train_optim_groups.py")),
    "dataplane/plane_state.py": ModuleTests(
        ("tests/dataplane/test_plane.py", _DURABILITY, "tests/dataplane/test_plane_speeds.py",
         "tests/dataplane/test_group_commit.py"),
        (_RANDOM_KILLS,)),
    "dataplane/mixer.py": ModuleTests(
        ("tests/dataplane/test_mixer.py", "tests/dataplane/test_bulk_draw.py",
         "tests/dataplane/test_plane_golden.py"),
        _MIXER_PROPERTIES),
    "dataplane/catalog.py": ModuleTests(
        ("tests/dataplane/test_catalog.py", "tests/dataplane/test_mixer.py",
         "tests/dataplane/test_bulk_draw.py", "tests/dataplane/test_plane_golden.py"),
        ("tests/dataplane/test_spec_remote.py", *_MIXER_PROPERTIES)),
    "dataplane/windows.py": ModuleTests(
        ("tests/dataplane/test_bulk_draw.py", "tests/balancer/test_static_layout.py",
         "tests/dataplane/test_plane_speeds.py")),
    "tools/train/guard.py": ModuleTests(
        ("tests/tools/test_guard_units.py",),
        ("tests/tools/test_train_guard.py", "tests/tools/test_guard_router_bias.py")),
    "tools/train/checkpoint.py": ModuleTests(
        ("tests/tools/test_checkpoint_prune.py", "tests/tools/test_checkpoint_rank_verdicts.py",
         "tests/tools/test_checkpoint_manifest.py"),
        ("tests/tools/test_checkpoint_manifest.py::"
         "test_resume_of_a_changed_checkpoint_is_one_line_and_leaves_the_run",  # 18 s
         "tests/tools/test_checkpoint_crash.py", "tests/tools/test_train_init_run.py")),
    "tools/train/optim_groups.py": ModuleTests(
        ("tests/tools/test_optim_groups_partial.py",),
        ("tests/tools/test_train_optim_groups.py",)),
    "tools/train/held_out.py": ModuleTests(
        ("tests/tools/test_held_out_scoring.py",),
        ("tests/tools/test_train_eval.py",)),
    "tools/train/records.py": ModuleTests(  # the step audit's training runs: 11-15 s each
        ("tests/tools/test_guard_units.py",),
        ("tests/tools/test_step_audit.py", "tests/tools/test_train.py",
         "tests/tools/test_rank_speeds.py")),
    "loaders/chat.py": ModuleTests(
        ("tests/loaders/test_chat.py", "tests/loaders/test_conversation_templates.py"),
        ("tests/loaders/test_chat.py::"  # the one test of the two files that builds the demo
         "test_target_tokens_of_other_sources_count_the_decoded_labels",)),
    "loaders/conversation.py": ModuleTests(
        ("tests/loaders/test_conversation.py", "tests/loaders/test_importers.py")),
    "loaders/sequence.py": ModuleTests(
        ("tests/loaders/test_sequence.py", "tests/loaders/test_chunks.py"),
        ("tests/parallel/test_sp.py",)),
    "loaders/remote_cache.py": ModuleTests(
        ("tests/loaders/test_cache_edges.py", "tests/loaders/test_remote_cache.py")),
    "loaders/ranged_file.py": ModuleTests(
        ("tests/loaders/test_ranged_read_ahead.py", "tests/loaders/test_index_remote.py")),
    "loaders/assemble.py": ModuleTests(
        ("tests/loaders/test_decode_work.py", "tests/loaders/test_chunks.py")),
    "balancer/split.py": ModuleTests(
        ("tests/balancer/test_split.py", "tests/balancer/test_baselines.py",
         "tests/balancer/test_cost.py")),
    "balancer/pack.py": ModuleTests(
        ("tests/balancer/test_pack.py", "tests/balancer/test_planner.py")),
    "balancer/assign.py": ModuleTests(
        ("tests/balancer/test_assign.py", "tests/balancer/test_ranktree.py",
         "tests/balancer/test_speeds_planner.py")),
    "parallel/reshard.py": ModuleTests(
        ("tests/parallel/test_reshard.py", "tests/test_plan.py")),
}


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One Cosmic Ray mutation: ``occurrence`` counts the operator's positions in the file."""

    file: str  # relative to the repository
    operator: str
    occurrence: int
    line: int
    column: int


def enumerate_mutants(source: str, file: str) -> list[Mutant]:
    """Every mutation Cosmic Ray's argument-free operators make in ``source``, but those inside
    annotations of a module with ``from __future__ import annotations``: Python never
    evaluates them there (``-> str | None`` made ``-> str & None`` is equivalent)."""
    from cosmic_ray import plugins
    from cosmic_ray.ast import ast_nodes, get_ast

    tree = get_ast(source)
    skipped = _annotation_spans(tree) if _postponed_annotations(source) else []
    mutants = []
    for name in plugins.operator_names():
        operator_class = plugins.get_operator(name)
        if operator_class.arguments():  # VariableReplacer/Inserter: need per-run arguments
            continue
        operator = operator_class()
        positions = (start for node in ast_nodes(tree)
                     for start, _ in operator.mutation_positions(node))
        mutants += [Mutant(file, name, i, line, column)
                    for i, (line, column) in enumerate(positions)
                    if not any(start <= (line, column) < end for start, end in skipped)]
    return mutants


def _postponed_annotations(source: str) -> bool:
    return any(isinstance(node, ast.ImportFrom) and node.module == "__future__"
               and any(alias.name == "annotations" for alias in node.names)
               for node in ast.parse(source).body)


def _annotation_spans(tree) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) of every annotation in a parso tree: parameters', returns', variables'."""
    from cosmic_ray.ast import ast_nodes

    spans = []
    for node in ast_nodes(tree):
        if node.type in ("funcdef", "param"):
            annotation = node.annotation
        elif node.type == "annassign":  # `: T` or `: T = value`
            annotation = node.children[1]
        else:
            continue
        if annotation is not None:
            spans.append((annotation.start_pos, annotation.end_pos))
    return spans


def sample(mutants: list[Mutant], limit: int, seed: int) -> list[Mutant]:
    """At most ``limit`` mutants, the same ones for the same seed: code sites (line, column)
    in a seeded order, one mutant from each before any gets a second, so a sample spreads
    over the module instead of following where operators pile up (a ``/`` has 12 swaps)."""
    if len(mutants) <= limit:
        return sorted(mutants, key=_order)
    rng = random.Random(f"{seed}:{mutants[0].file}")  # a str seed: the same in every process
    sites: dict[tuple[int, int], list[Mutant]] = {}
    for m in sorted(mutants, key=_order):
        sites.setdefault((m.line, m.column), []).append(m)
    queues = list(sites.values())
    rng.shuffle(queues)
    for queue in queues:
        rng.shuffle(queue)
    picked: list[Mutant] = []
    while len(picked) < limit:
        for queue in queues:
            if queue and len(picked) < limit:
                picked.append(queue.pop())
    return sorted(picked, key=_order)


def _order(m: Mutant) -> tuple:
    return m.line, m.column, m.operator, m.occurrence


def mutate(source: str, mutant: Mutant) -> str:
    from cosmic_ray import plugins
    from cosmic_ray.mutating import mutate_code

    mutated = mutate_code(source, plugins.get_operator(mutant.operator)(), mutant.occurrence)
    if mutated is None:
        raise ValueError(f"{mutant} is not a mutation of this source")
    return mutated


def line_diff(original: str, mutated: str) -> str:
    """The changed lines only (``-`` old, ``+`` new), as survivors are read."""
    return "\n".join(line for line in difflib.unified_diff(
        original.splitlines(), mutated.splitlines(), lineterm="", n=0)
        if line[:1] in "-+" and not line.startswith(("---", "+++")))


class RestoreError(RuntimeError):
    """A mutated file could not be put back as it was: stop everything."""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def applied(path: Path, text: str) -> Iterator[None]:
    """``path`` holds ``text`` inside the block; its original bytes after it, however the block
    ends (an exception, Ctrl-C), checked by hash."""
    original = path.read_bytes()
    digest = hashlib.sha256(original).hexdigest()
    try:
        path.write_text(text, encoding="utf-8")
        yield
    finally:
        path.write_bytes(original)
        if sha256(path) != digest:
            raise RestoreError(f"{path} differs from its original after a mutant; stopping")


def make_work_copy(repo: Path, work: Path) -> Path:
    """A fresh copy of the repository's files (git's tracked and untracked-not-ignored ones,
    as they are in the working tree) at ``work``, which must lie outside ``repo``."""
    repo, work = repo.resolve(), work.resolve()
    if work == repo or work.is_relative_to(repo) or repo.is_relative_to(work):
        raise ValueError(f"--work {work} must lie outside the repository {repo}")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=repo, capture_output=True, check=True)
    if work.exists():
        shutil.rmtree(work)
    for name in listed.stdout.decode().split("\0"):
        source = repo / name
        if name and source.is_file():  # a tracked file deleted in the working tree: skip
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, work / name)
    return work


@dataclasses.dataclass
class Outcome:
    status: str  # "killed", "survived", "timed_out" or "error" (pytest could not run them)
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
    status = "survived" if code == 0 else "killed" if killed else "error"
    return Outcome(status, seconds, output[-_TAIL:], code)


def _pytest_args(tests: tuple[str, ...], deselect: tuple[str, ...]) -> list[str]:
    """Stop at the first failure; no cache written into the copy; the demo handed over."""
    return ["-x", "-q", "-p", "no:cacheprovider", "-p", PLUGIN, *tests,
            *(f"--deselect={d}" for d in deselect)]


def runner_in(work: Path, env: dict[str, str]) -> Callable[..., Outcome]:
    """The subprocess runner (``--runner subprocess``): a new ``python -m pytest`` per run in
    ``work``, niced (the machine is shared); a timeout kills the whole process group."""

    def run(tests: tuple[str, ...], deselect: tuple[str, ...], timeout: float) -> Outcome:
        command = [sys.executable, "-m", "pytest", *_pytest_args(tests, deselect)]
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
           "PIL.ImageDraw", "tokenizers", "soundfile", "transformers")

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

    def __call__(self, tests: tuple[str, ...], deselect: tuple[str, ...],
                 timeout: float) -> Outcome:
        start = time.perf_counter()
        self._server.stdin.write(json.dumps({"args": _pytest_args(tests, deselect)}).encode()
                                 + b"\n")
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
    work copy as its directory): requests on stdin, one JSON line each, ``{"args": [...]}``;
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
                _run_child(json.loads(line)["args"], output.fileno())
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


def _run_child(args: list[str], output: int) -> None:
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
        # the plugins were imported before pytest could rewrite their asserts: it warns, once
        # per plugin, in every run's output
        code = int(pytest.main(["-W", "ignore::pytest.PytestAssertRewriteWarning", *args]))
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _tests_for(module: str, slow: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(node ids to run, node ids to deselect) for the fast or the slow run of a module."""
    entry = MODULE_TESTS[module]
    if slow:
        return entry.slow, ()
    fast_files = {t.split("::")[0] for t in entry.fast}
    return entry.fast, tuple(t for t in entry.slow if "::" in t and t.split("::")[0] in fast_files)


def reason_key(survivor: dict) -> tuple:
    """What identifies a survivor across runs and small edits elsewhere in the file."""
    return survivor["file"], survivor["operator"], survivor["diff"]


def check_module(module: str, work: Path, runner: Callable[..., Outcome]) -> dict:
    """The runs before a module's mutants (``--check`` runs only these): the tests must pass
    unmutated (``baseline_seconds`` sets the mutants' timeout) and fail with the module unable
    to import (the canary); ``error`` says which did not."""
    path = work / module
    tests, deselect = _tests_for(module, slow=False)
    result: dict = {"tests": list(tests), "deselected": list(deselect),
                    "slow_tests": list(MODULE_TESTS[module].slow)}
    baseline = runner(tests, deselect, 1800)
    result["baseline_seconds"] = round(baseline.seconds, 1)
    if baseline.status != "survived":
        return {**result, "error": f"the tests fail unmutated: {baseline.tail[-500:]}"}
    timeout = max(3 * baseline.seconds, baseline.seconds + 30)
    with applied(path, path.read_text(encoding="utf-8") + CANARY):
        canary = runner(tests, deselect, timeout)
    result["canary_seconds"] = round(canary.seconds, 1)
    if canary.status == "survived":
        return {**result, "error": "a module that cannot be imported passed its tests: they do "
                                   "not run against the work copy, or never import it"}
    if canary.status != "killed":
        return {**result, "error": f"the canary's run was no test failure ({canary.status}, "
                                   f"pytest's exit code {canary.code}): {canary.tail[-500:]}"}
    return {**result, "timeout_seconds": timeout}


def run_module(module: str, work: Path, runner: Callable[..., Outcome], *, max_mutants: int,
               seed: int, recheck_slow: bool = False, reasons: dict | None = None,
               log: Callable[[str], None] = print) -> dict:
    """Mutation results of one module (``module``: a path relative to the repository), run in
    ``work`` with ``runner(tests, deselect, timeout) -> Outcome``."""
    started = time.perf_counter()
    path = work / module
    source = path.read_text(encoding="utf-8")
    result = check_module(module, work, runner)
    if "error" in result:
        return result
    tests, deselect = _tests_for(module, slow=False)
    timeout = result.pop("timeout_seconds")
    generated = enumerate_mutants(source, module)
    picked = sample(generated, max_mutants, seed)
    counts = dict.fromkeys(("killed", "survived", "timed_out", "errors"), 0)
    survivors, errors = [], []
    for i, mutant in enumerate(picked, 1):
        mutated = mutate(source, mutant)
        with applied(path, mutated):
            outcome = runner(tests, deselect, timeout)
        counts[{"error": "errors"}.get(outcome.status, outcome.status)] += 1
        entry = {"file": module, "line": mutant.line, "column": mutant.column,
                 "operator": mutant.operator, "occurrence": mutant.occurrence,
                 "diff": line_diff(source, mutated)}
        if outcome.status == "survived":
            survivors.append({**entry, "reason": ""})
        elif outcome.status == "error":
            errors.append({**entry, "output": outcome.tail[-500:]})
        log(f"  {module} {i}/{len(picked)} line {mutant.line} {mutant.operator}: "
            f"{outcome.status} ({outcome.seconds:.1f} s)")
    if recheck_slow and MODULE_TESTS[module].slow:
        slow_tests, _ = _tests_for(module, slow=True)
        for s in survivors:
            mutant = Mutant(module, s["operator"], s["occurrence"], s["line"], s["column"])
            with applied(path, mutate(source, mutant)):
                s["slow_tests"] = runner(slow_tests, (), 10 * timeout).status
    for s in survivors:
        s["reason"] = (reasons or {}).get(reason_key(s), "")
    return {**result, "timeout_seconds": round(timeout, 1), "generated": len(generated),
            "sampled": len(picked), **counts, "seconds": round(time.perf_counter() - started, 1),
            "survivors": survivors, "error_mutants": errors}


def build_demo(work: Path, env: dict[str, str], demo: Path) -> set[str]:
    """The suite's demo built once in ``work`` from the unmutated code; the files (relative to
    ``work``) of the project's modules that building it imported."""
    script = ("import json, sys; from pathlib import Path; from tests.demo_data import build; "
              "build(Path(sys.argv[1])); print(json.dumps([getattr(m, '__file__', None) "
              "for n, m in list(sys.modules.items()) if n.startswith('omniscale')]))")
    done = subprocess.run([sys.executable, "-c", script, str(demo)], cwd=work, env=env,
                          capture_output=True, text=True, check=True)
    files = json.loads(done.stdout.strip().splitlines()[-1])
    return {str(Path(f).resolve().relative_to(work)) for f in files
            if f and Path(f).resolve().is_relative_to(work)}


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef, request):
    """As a pytest plugin (``-p``): the session's ``demo_root`` is the prebuilt demo, when the
    driver says where it is; otherwise the suite's own fixture builds it."""
    demo = os.environ.get(DEMO_ENV)
    if not demo or fixturedef.argname != "demo_root":
        return None
    fixturedef.cached_result = (Path(demo), fixturedef.cache_key(request), None)
    return Path(demo)


def load_reasons(path: Path) -> dict:
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    return {reason_key(s): s["reason"] for m in old.get("modules", {}).values()
            for s in m.get("survivors", ()) if s.get("reason")}


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: every mutated file is restored


@contextlib.contextmanager
def runner_of(kind: str, work: Path, env: dict[str, str]) -> Iterator[Callable[..., Outcome]]:
    """A module run's test runner, ``fork`` (:class:`ForkRunner`) or ``subprocess``
    (:func:`runner_in`), stopped after the run."""
    if kind == "subprocess":
        yield runner_in(work, env)
        return
    with ForkRunner(work, env) as runner:
        yield runner


def check(modules: list[str], work: Path,
          runner_for: Callable[[str], contextlib.AbstractContextManager], *, max_mutants: int,
          log: Callable[[str], None] = print) -> dict:
    """``--check``: each module's baseline and canary (:func:`check_module`, with the runner
    ``runner_for(module)`` gives), the baseline once more with the module's file written anew
    as a mutant's is, its mutant count and the time its run of at most ``max_mutants`` would
    take: the runs here and each mutant at the faster baseline (at most: a killed mutant stops
    at its first failure, though a hang takes three times as long). The first run in a copy
    compiles numba's cached kernels into it (journal.py's tests: 41 s, then 6 s); a rewritten
    file's own kernels compile again, for every mutant, and in the second run here."""
    results = {}
    for module in modules:
        started = time.perf_counter()
        with runner_for(module) as run:
            result = check_module(module, work, run)
            if "error" not in result:
                path = work / module
                with applied(path, path.read_text(encoding="utf-8")):  # the same text, anew
                    again = run(*_tests_for(module, slow=False), result["timeout_seconds"])
                result["baseline_again_seconds"] = round(again.seconds, 1)
        generated = len(enumerate_mutants((work / module).read_text(encoding="utf-8"), module))
        sampled = min(generated, max_mutants)
        each = min(result["baseline_seconds"], result.get("baseline_again_seconds", math.inf))
        result.update(generated=generated, sampled=sampled,
                      check_seconds=round(time.perf_counter() - started, 1),
                      estimate_seconds=round(time.perf_counter() - started + sampled * each))
        results[module] = result
        log(f"{module}: baseline {result['baseline_seconds']:.1f} s, "
            + (result["error"] if "error" in result else
               f"again {result['baseline_again_seconds']:.1f} s, canary killed "
               f"({result['canary_seconds']:.1f} s), {generated} mutants, {sampled} to run: "
               f"about {result['estimate_seconds'] / 60:.1f} min"))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", action="append", choices=sorted(MODULE_TESTS),
                        help="a module to mutate (repeatable; default: all of them)")
    parser.add_argument("--max-mutants", type=int, default=100,
                        help="mutants per module at most, sampled (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    parser.add_argument("--out", default="docs/bench/mutation.json", type=Path)
    parser.add_argument("--work", default="/tmp/omniscale-mutation", type=Path,
                        help="the repository's copy the mutants are run in (wiped first)")
    parser.add_argument("--runner", choices=("fork", "subprocess"), default="fork",
                        help="fork (default): a process per module imports torch and the rest "
                             "once and forks each test run from it; subprocess: a new "
                             "`python -m pytest` per test run, 5-9 s slower each")
    parser.add_argument("--recheck-slow", action="store_true",
                        help="run each module's slow tests on the mutants its fast ones miss")
    parser.add_argument("--list", action="store_true",
                        help="print each module's tests and mutant counts; run nothing")
    parser.add_argument("--check", action="store_true",
                        help="run each module's tests unmutated and with the canary only, no "
                             "mutant, and estimate the full run's time; writes no --out")
    args = parser.parse_args(argv)
    modules = args.module or list(MODULE_TESTS)
    if args.list:
        for module in modules:
            generated = enumerate_mutants((REPO / module).read_text(), module)
            print(f"{module}: {len(generated)} mutants, "
                  f"{min(len(generated), args.max_mutants)} run; tests "
                  f"{' '.join(MODULE_TESTS[module].fast)}")
        return 0
    signal.signal(signal.SIGTERM, _raise_interrupt)
    from importlib.metadata import version

    reasons = load_reasons(args.out)
    began = time.perf_counter()
    work = make_work_copy(REPO, args.work / "repo")
    env = {**os.environ, "PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1"}
    demo_imports = build_demo(work, env, args.work / "demo")

    def env_of(module: str) -> dict[str, str]:
        # a module the demo is built with must build it mutated: the suite's fixture then
        return env if module in demo_imports else {**env, DEMO_ENV: str(args.work / "demo")}

    if args.check:
        print(f"work copy and demo: {time.perf_counter() - began:.0f} s", flush=True)
        try:
            results = check(modules, work,
                            lambda module: runner_of(args.runner, work, env_of(module)),
                            max_mutants=args.max_mutants, log=lambda line: print(line, flush=True))
        except KeyboardInterrupt:
            return 130
        total = time.perf_counter() - began + sum(
            r["estimate_seconds"] - r["check_seconds"] for r in results.values())
        print(f"a full run (--max-mutants {args.max_mutants}, --runner {args.runner}): about "
              f"{total / 60:.0f} min; {sum('error' in r for r in results.values())} of "
              f"{len(results)} modules failed their check")
        return 1 if any("error" in r for r in results.values()) else 0
    from omniscale.tools.bench.provenance import provenance

    # the commit the mutants were made from (a tree with uncommitted changes says so)
    report = {"command": " ".join(["tools/bench/mutation.py", *(argv or sys.argv[1:])]),
              **provenance(), "tool": {"name": "cosmic-ray", "version": version("cosmic-ray")},
              "seed": args.seed, "max_mutants": args.max_mutants, "runner": args.runner,
              "modules": {}}
    started = time.perf_counter()
    try:
        for module in modules:
            print(f"{module}: {' '.join(MODULE_TESTS[module].fast)}", flush=True)
            with runner_of(args.runner, work, env_of(module)) as runner:
                result = run_module(module, work, runner, max_mutants=args.max_mutants,
                                    seed=args.seed, recheck_slow=args.recheck_slow,
                                    reasons=reasons, log=lambda line: print(line, flush=True))
            report["modules"][module] = {**result, "demo_prebuilt": module not in demo_imports}
            _write(args.out, report, started)
    except KeyboardInterrupt:
        report["interrupted"] = True
        _write(args.out, report, started)
        return 130
    for module, r in report["modules"].items():
        print(f"{module}: " + (r.get("error") or f"{r['killed']} killed, {r['survived']} "
              f"survived, {r['timed_out']} timed out of {r['sampled']} ({r['seconds']:.0f} s)"))
    return 0


def _write(out: Path, report: dict, started: float) -> None:
    report["seconds"] = round(time.perf_counter() - started, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
