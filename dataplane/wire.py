"""What crosses the plane's wire: Arrow IPC streams, never pickle.

Plans travel as Arrow tables (Flight ``do_get``). Small requests and replies (a commit, a
status) travel as one-row Arrow tables serialised to IPC bytes, so a peer in any language can
read them and no bytes from the network are ever unpickled.
"""

from __future__ import annotations

import pyarrow as pa


def encode(record: dict) -> bytes:
    """One dict as a one-row Arrow IPC stream."""
    table = pa.Table.from_pylist([record])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def decode(data: bytes | pa.Buffer) -> dict:
    """The dict :func:`encode` wrote; ValueError for anything that is not one."""
    try:
        table = pa.ipc.open_stream(data).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"not an Arrow IPC record ({e})") from None
    if table.num_rows != 1:
        raise ValueError(f"expected one record, got {table.num_rows}")
    return table.to_pylist()[0]
