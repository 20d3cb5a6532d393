"""Media kinds: what an encoder item is. The position of a kind in :data:`MEDIA_KINDS` is its
id wherever a plan, a batch or a reshard carries the kind as a number (``media_kind_M``)."""

from __future__ import annotations

MEDIA_KINDS = ("image", "video", "audio")
IMAGE, VIDEO, AUDIO = range(len(MEDIA_KINDS))
