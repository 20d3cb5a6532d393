"""Shard writers: plain WebDataset tars and Parquet files, byte-identical for identical input."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# Fixed member metadata: without it a tar records who wrote it and when, and two
# generations of the same data would differ.
MTIME = 1_700_000_000
OWNER = "omniscale"

Members = list[tuple[str, bytes]]  # (suffix after "KEY.", data), in write order


def write_tar(path: Path, samples: list[tuple[str, Members]]) -> int:
    """Write ``KEY.suffix`` members, each sample's contiguous, into an uncompressed tar.

    Keys must not contain dots (WebDataset takes the key up to the first dot of the basename).
    Returns the file size in bytes.
    """
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples:
            if "." in key or "/" in key:
                raise ValueError(f"sample key {key!r}: must contain no '.' or '/'")
            for suffix, data in members:
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size, info.mtime, info.mode = len(data), MTIME, 0o644
                info.uid = info.gid = 0
                info.uname = info.gname = OWNER
                tar.addfile(info, io.BytesIO(data))
    return path.stat().st_size


def write_parquet(path: Path, rows: list[tuple[str, str]], row_group_size: int) -> int:
    """Write (key, text) rows as a Parquet file with columns ``key`` and ``text`` (strings),
    in row groups of ``row_group_size``. Returns the file size in bytes."""
    table = pa.table({"key": pa.array([k for k, _ in rows], pa.string()),
                      "text": pa.array([t for _, t in rows], pa.string())})
    pq.write_table(table, path, row_group_size=row_group_size, compression="zstd")
    return path.stat().st_size
