"""The data plane: one service per job that owns every source's file state, mixes sources by
schedule, plans every step for every rank, and records what each step consumed.

Public entry points: :class:`PlaneClient` (trainer side), :func:`start_embedded` (the plane
in a thread of this process), :class:`PlaneConfig`. They are imported lazily so that light
users (the spec loader, the CLI's help) do not pay for numba and Flight.
"""


def __getattr__(name):
    if name == "PlaneClient":
        from omniscale.dataplane.client import PlaneClient
        return PlaneClient
    if name in ("start_embedded", "EmbeddedPlane"):
        from omniscale.dataplane import embedded
        return getattr(embedded, name)
    if name in ("PlaneConfig", "DataPlane"):
        from omniscale.dataplane import plane
        return getattr(plane, name)
    raise AttributeError(f"module 'dataplane' has no attribute {name!r}")
