"""Which encoder towers a mixing spec's sources need: ``model.vision`` / ``model.audio`` set to
``auto`` build a tower only for a spec that has a source of its kind.

A caption template names its kind (``image_caption`` and ``video_caption``: the vision tower,
``audio_caption``: the audio tower; ``text``: none). An ``interleaved`` or ``conversation``
source may hold any media, so its index decides: the media lists it records per sample
(``image_patches``, ``video_patches``, ``audio_frames``) say which kinds occur. A source
without a readable index yet counts as holding every kind -- a tower too many costs memory,
a tower too few stops the run at its first media item.
"""

from __future__ import annotations

import pyarrow.compute as pc

from omniscale.errors import UserError

TOWERS = ("vision", "audio")
# a template's towers; None: the source's index decides
TEMPLATE_TOWERS: dict[str, frozenset[str] | None] = {
    "text": frozenset(),
    "image_caption": frozenset({"vision"}),
    "video_caption": frozenset({"vision"}),
    "audio_caption": frozenset({"audio"}),
    "interleaved": None,
    "conversation": None,
}
# the index's media columns and the tower each one's items go through
INDEX_COLUMNS = {"image_patches": "vision", "video_patches": "vision", "audio_frames": "audio"}


def spec_towers(spec) -> frozenset[str]:
    """The towers (``vision``, ``audio``) the sources of ``spec`` (a ``MixSpec``) feed."""
    needed: set[str] = set()
    for source in spec.sources:
        towers = TEMPLATE_TOWERS.get(source.template)
        if towers is None:
            towers = _indexed_towers(source.index)
        needed |= towers
        if needed == set(TOWERS):
            break
    return frozenset(needed)


def _indexed_towers(index_dir) -> frozenset[str]:
    """The towers whose media occur in a source's index (every tower when it has none)."""
    from omniscale.index_schema import read_index

    try:
        table = read_index(index_dir, columns=list(INDEX_COLUMNS))
    except UserError:  # not indexed yet: assume the worst (module docstring)
        return frozenset(TOWERS)
    return frozenset(tower for column, tower in INDEX_COLUMNS.items()
                     if table.num_rows and (pc.max(pc.list_value_length(table[column]))
                                            .as_py() or 0) > 0)
