"""One sample's cost features: the index columns the planner balances on.

The sequence of a sample (``omniscale.layout``) is its text with every media marker expanded to
the item's placeholder block, unmarked media placed first, then ``<eos>``. So a sample whose
text marks some media of a kind must mark all of them, one marker per item, in order;
otherwise the decoder could not place them and the sample is corrupt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omniscale.geometry import MediaGeometry, audio_tokens, vision_tokens
from omniscale.layout import DEFAULT_SPECIAL_TOKENS, SpecialTokens, count_markers
from omniscale.loaders.probe import Corrupt

Grid = tuple[int, int, int]


@dataclass
class SampleFeatures:
    """Feature columns of one index row (lists are in media order)."""

    text_tokens: int
    image_patches: list[int] = field(default_factory=list)
    video_patches: list[int] = field(default_factory=list)
    audio_frames: list[int] = field(default_factory=list)
    llm_tokens: int = 0
    target_tokens: int | None = None  # labels that are targets (``shard_index.target_tokens``)


def sample_features(text_tokens: int, text: str, image_grids: list[Grid],
                    video_grids: list[Grid], audio_mel_frames: list[int],
                    g: MediaGeometry, special: SpecialTokens = DEFAULT_SPECIAL_TOKENS
                    ) -> SampleFeatures:
    """Features of a sample from its text's token count and its probed media.

    Raises :class:`Corrupt` when the text's markers do not match the media items.
    """
    check_markers(text, {"image": len(image_grids), "video": len(video_grids),
                         "audio": len(audio_mel_frames)}, special)
    media_tokens = (sum(vision_tokens(grid, g) for grid in (*image_grids, *video_grids))
                    + sum(audio_tokens(frames) for frames in audio_mel_frames))
    return SampleFeatures(
        text_tokens=text_tokens,
        image_patches=[t * h * w for t, h, w in image_grids],
        video_patches=[t * h * w for t, h, w in video_grids],
        audio_frames=list(audio_mel_frames),
        llm_tokens=text_tokens + media_tokens,
    )


def check_markers(text: str, media_counts: dict[str, int],
                  special: SpecialTokens = DEFAULT_SPECIAL_TOKENS) -> None:
    """Raise :class:`Corrupt` unless each kind is either unmarked or marked once per item."""
    for kind, markers in count_markers(text, special).items():
        items = media_counts.get(kind, 0)
        if markers and markers != items:
            raise Corrupt(f"text has {markers} {special.markers[kind]} marker(s) but the sample "
                          f"has {items} {kind} member(s)")
