"""Media kinds: what an encoder item is. The position of a kind in :data:`MEDIA_KINDS` is its
id wherever a plan, a batch or a reshard carries the kind as a number (``media_kind_M``):
:func:`kind_id` is the one place a name becomes that number."""

from __future__ import annotations

MEDIA_KINDS = ("image", "video", "audio")
IMAGE, VIDEO, AUDIO = range(len(MEDIA_KINDS))
_IDS = {kind: i for i, kind in enumerate(MEDIA_KINDS)}


def kind_id(kind: str) -> int:
    """The id of the media kind named ``kind``."""
    try:
        return _IDS[kind]
    except KeyError:
        raise ValueError(f"media kind {kind!r} is not one of {', '.join(MEDIA_KINDS)}") from None
