"""Header probes refuse hostile or degenerate media with a short reason, never an exception."""

from __future__ import annotations

import struct
import zlib

import pytest

from omniscale.geometry import MediaGeometry
from omniscale.loaders.probe import Corrupt, decode_text, probe_audio, probe_image, probe_video
from tests.loaders.index_fixtures import audio_bytes, image_bytes


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` (no pixel data behind it)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b""))
            + chunk(b"IEND", b""))


@pytest.mark.parametrize("side", [10_000, 20_000])
def test_decompression_bomb_is_refused(side):
    with pytest.raises(Corrupt, match="image too large"):
        probe_image(png_claiming(side, side), MediaGeometry())


def test_degenerate_media():
    g = MediaGeometry()
    with pytest.raises(Corrupt, match="aspect ratio"):
        probe_image(image_bytes(1, 300, "PNG"), g)
    with pytest.raises(Corrupt, match="not a video"):
        probe_video(b"", g)
    with pytest.raises(Corrupt, match="not audio"):
        probe_audio(b"RIFF\x00\x00", g)
    with pytest.raises(Corrupt, match="not a valid image|not an image"):
        probe_image(image_bytes(40, 40, "PNG")[:60], g)
    assert probe_audio(audio_bytes(0.01, 16000), g) == 3  # shorter than one FFT: padded
    with pytest.raises(Corrupt, match=r"byte 0xc3 at byte 2"):
        decode_text("ab\xe9".encode("utf-8")[:3])
