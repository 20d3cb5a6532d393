"""What a process of the loader's pool does with a work item: decode a micro-batch's samples
(:class:`~omniscale.loaders.worker.TimedDecoder`), collate it (``loaders.chunks``) and pack
it into one shared buffer (``loaders.transfer``) for the trainer. Kept apart from
``loaders.worker`` so that a Ray decoding actor, which uses the decoder alone, never imports
torch (the collated batch is made of tensors)."""

from __future__ import annotations

from omniscale.geometry import MediaGeometry
from omniscale.loaders.remote_io import add_stats
from omniscale.loaders.transfer import ShmRing, pack
from omniscale.loaders.worker import DecoderSpec, TimedDecoder
from omniscale.loaders.worker_pool import worker_index


class RefDataset:
    """A map-style dataset whose "indices" are work items ``(tag, chunk)``
    (``loaders.chunks.ChunkWork``, None for a step with nothing to decode): the loader hands
    each worker a micro-batch's refs, the worker decodes and packs them. Stateless apart from
    its decoder, built lazily in the worker process (after the fork) so no open file crosses
    processes."""

    def __init__(self, spec: DecoderSpec, timeout: float | None, geometry: MediaGeometry,
                 ring: ShmRing | None = None) -> None:
        self.spec, self.timeout, self.geometry = spec, timeout, geometry
        self.ring = ring  # the workers' slots to hand items over in (``loaders.transfer``)
        self._decoder: TimedDecoder | None = None

    def __getitem__(self, item: tuple[object, object]) -> tuple[object, object]:
        from omniscale.loaders.chunks import decode_chunk  # it builds on this module

        if self._decoder is None:
            self._decoder = TimedDecoder(self.spec, self.timeout)
        tag, chunk = item
        io: dict[str, int] = {}

        def decode_all(work):
            outs = self._decoder.decode_all(work)
            add_stats(io, outs.io)
            return outs

        out = decode_chunk(chunk, decode_all, self.geometry)
        out.io = io  # the reader's counters for this chunk (``DecodedList.io``)
        # Packed only to leave a worker process (num_workers=0 decodes in the trainer's).
        worker = worker_index()
        return tag, out if worker is None else pack(out, self.ring, worker)

    def close(self) -> None:
        """Close the decoder (its reader's open shards), in the process that used it."""
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None
