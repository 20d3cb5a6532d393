"""Session fixtures that the xdist workers share: built by one, loaded by the others."""

from __future__ import annotations


def once_per_run(tmp_path_factory, worker_id: str, name: str, build):
    """``build(directory)`` once for the whole run, and its result: the first xdist worker to
    ask builds it (under a file lock, in the directory the workers' temporary directories
    share) and saves the result beside it (``torch.save``: paths, rows and tensors alike); the
    others wait for it and load it. Without xdist it is built here."""
    if worker_id == "master":
        return build(tmp_path_factory.mktemp(name))
    import torch
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent
    directory, result = shared / name, shared / f"{name}.pt"
    with FileLock(str(shared / f"{name}.lock")):
        if not result.exists():  # a worker that failed here left no result: build again
            directory.mkdir(exist_ok=True)
            torch.save(build(directory), result)
    return torch.load(result, weights_only=False)
