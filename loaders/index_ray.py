"""``omniscale data index --ray``: the per-shard work as a Ray Data pipeline on a cluster.

The driver lists shards, decides what to re-index and writes the file exactly as a local run
does (``loaders.index``); only ``index_shard`` runs on the cluster, one row of the dataset per
shard, mapped by Ray tasks. Each result comes back pickled (the Arrow table as it was
built), so the index is byte-identical to a local run's.

Workers may run on other machines: they get the tokenizer's bytes (an argument of the map,
sent once per run) rather than the driver's path, and read the shards where they are --
an object-store URL, or a file system every node mounts at the same path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

from omniscale.errors import UserError
from omniscale.loaders.shard_index import ShardResult, index_shard


class RayRunner:
    """Runs ``index_shard`` tasks on Ray: the cluster at ``address`` (``auto``: the one this
    machine belongs to), or a local instance started here (and stopped when ``stack``
    closes) when ``address`` is None and no ``RAY_ADDRESS`` is set. A Ray session that is
    already initialised is used as it is."""

    def __init__(self, stack: ExitStack, address: str | None = None) -> None:
        self.address = address
        self._stack = stack
        self._started = False

    def _connect(self) -> None:
        import ray

        if not self._started:
            self._started = True
            if not ray.is_initialized():
                if self.address:  # ray.init would retry a dead address for minutes, silently
                    from omniscale.loaders.ray_cluster import reachable

                    reachable(self.address, what="--ray")
                try:
                    ray.init(address=self.address, include_dashboard=False,
                             logging_level=logging.WARNING, configure_logging=False)
                except (ConnectionError, RuntimeError, ValueError) as e:
                    where = self.address or os.environ.get("RAY_ADDRESS") or "a local instance"
                    raise UserError(f"--ray {where}: cannot start or join Ray "
                                    f"({' '.join(str(e).split())[:200]})") from None
                self._stack.callback(ray.shutdown)

    def results(self, tasks: list[tuple]) -> Iterator[ShardResult]:
        """``index_shard(*task)`` of every task, as the pipeline yields them."""
        self._connect()
        import ray.data

        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # ours counts shards (loaders.index._run)
        context.print_on_execution_start = False
        # Ray Data's own notes (bars disabled, execution finished) are not the user's concern.
        logging.getLogger("ray.data").setLevel(logging.ERROR)
        blob = Path(tasks[0][3]).read_bytes()
        rows = [{"task": pickle.dumps(_portable(t))} for t in tasks]
        # Tasks, not actors: Ray reuses its worker processes (and their imports) across
        # tasks and runs, and the map function's arguments travel once per pipeline.
        dataset = ray.data.from_items(rows, override_num_blocks=len(rows)).map(
            _index_row, fn_kwargs={"tokenizer": blob}, num_cpus=1)
        for row in dataset.iter_rows():
            if row.get("error"):
                raise UserError(row["error"])
            yield pickle.loads(row["result"])


def _portable(task: tuple) -> tuple:
    """The task without the driver's tokenizer path (workers get the tokenizer's bytes)."""
    return task[:3] + (None,) + task[4:]


def _index_row(row: dict, tokenizer: bytes) -> dict:
    """One shard, on a Ray worker: its ShardResult pickled, or a UserError's line."""
    task = pickle.loads(row["task"])
    try:
        result = index_shard(*task[:3], str(_tokenizer_file(tokenizer)), *task[4:])
    except UserError as e:  # one line for the driver, not a Ray traceback
        return {"result": b"", "error": str(e)}
    return {"result": pickle.dumps(result), "error": ""}


def _tokenizer_file(tokenizer: bytes) -> Path:
    """The tokenizer as a file on this node, written once (named by its hash, so that a
    worker loads it once too: ``shard_index.token_counter`` caches by path)."""
    digest = hashlib.sha256(tokenizer).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"omniscale-tokenizer-{digest}.json"
    if not path.is_file():
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(tokenizer)
        os.replace(tmp, path)  # workers on one node may race to write it
    return path
