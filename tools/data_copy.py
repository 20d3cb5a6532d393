"""``omniscale data copy SPEC… --to URL``: a spec's sources into an object store, and the spec
that reads them there.

Each source's files (shards and ``_index.parquet``) go to ``URL/<its path below the spec's
directory>/`` (``URL/<source name>/`` for a source outside it) with the same relative names, so
the index's byte ranges stay valid and the plane plans from the copy without re-indexing. Each
spec is rewritten as ``<stem><suffix>.yaml`` (default ``_remote``, beside it or in ``out_dir``):
source paths point into the store, ``storage_options`` carry the endpoint (no credentials:
those come from the environment), everything else unchanged. Files already there with the same
size are skipped, so an interrupted copy resumes.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from omniscale.dataplane.spec import load_spec
from omniscale.errors import UserError
from omniscale.location import Location, check_storage_options, is_url


def copy_specs(specs: list[str | Path], to: str, storage_options: dict | None = None,
               suffix: str = "_remote", progress: bool = True,
               out_dir: str | Path | None = None) -> list[Path]:
    """Copy every source of ``specs`` under ``to``; return the rewritten specs' paths (beside
    each spec, or in ``out_dir``)."""
    if not is_url(to):
        raise UserError(f"--to: {to!r} is not an object-store URL (s3://bucket/prefix, …)")
    options = check_storage_options(storage_options or {}, "--storage-options")
    written, copied = [], set()
    for spec_file in specs:
        spec = load_spec(spec_file)
        data = yaml.safe_load(Path(spec_file).read_text(encoding="utf-8"))
        data.pop("index_dir", None)  # the indexes travel with the shards
        data["tokenizer"] = str(spec.tokenizer)
        for entry, source in zip(data["sources"], spec.sources):
            if not source.location.is_local:
                raise UserError(f"{spec_file}: source {source.name!r} is already remote "
                                f"({source.location.shown()})")
            dest = Location.of(to, options).join(_relative(source.location.local_path(),
                                                           spec.root, source.name))
            if dest.url not in copied:
                _copy_tree(source.location.local_path(), source.index.local_path(), dest,
                           progress)
                copied.add(dest.url)
            entry["path"] = dest.url
            if options:
                entry["storage_options"] = options
            if entry.get("chat_template") not in (None, "chatml", "tokenizer"):
                entry["chat_template"] = str(Path(source.chat_template))
        out = Path(out_dir or Path(spec_file).parent) / (Path(spec_file).stem + suffix + ".yaml")
        out.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
        load_spec(out, check_paths=False)  # the rewrite must still be a valid spec
        written.append(out)
    return written


def _relative(path: Path, root: Path, name: str) -> str:
    """Where a source goes under the destination: its path below the spec's directory (so
    the training and held-out copies of a source, same name, stay apart), else its name."""
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return name


def _copy_tree(source_dir: Path, index_dir: Path, dest: Location, progress: bool) -> None:
    from rich.console import Console
    from rich.progress import Progress

    files = sorted(p for p in source_dir.rglob("*") if p.is_file() and not p.name.startswith(
        ("_index.parquet.", "__index.parquet.", ".")))  # no index temp files (an older
    # release's too: another process may be writing one now), no dot files
    index = index_dir / "_index.parquet"
    if not index.is_file():
        raise UserError(f"{source_dir}: no index; run `omniscale data index` before copying")
    pairs = [(p, p.relative_to(source_dir).as_posix()) for p in files if p != index]
    pairs.append((index, "_index.parquet"))  # last: a reader never finds an index without shards
    fs, root = dest.fs()
    total = sum(p.stat().st_size for p, _ in pairs)
    console = Console(stderr=True)
    with Progress(console=console, disable=not progress or not console.is_terminal,
                  transient=True) as bar:
        task = bar.add_task(f"copy {source_dir.name} → {dest.shown()}", total=total)
        for path, rel in pairs:
            target = f"{root}/{rel}"
            try:
                same = fs.info(target)["size"] == path.stat().st_size
            except FileNotFoundError:
                same = False
            if not same:
                try:
                    fs.put_file(str(path), target)
                except (OSError, ValueError) as e:
                    raise UserError(f"{dest.shown()}/{rel}: upload failed "
                                    f"({' '.join(str(e).split())[:200]})") from None
            bar.advance(task, path.stat().st_size)
