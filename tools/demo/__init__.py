"""The demo omni dataset: real WebDataset tars and one Parquet source, made on the spot.

``omniscale data demo OUT`` calls :func:`generate`. Sources: stdlib Python text, pydoc topics
(Parquet), drawn images with captions, moving-shape videos, tone-sequence audio and interleaved
image-text documents, plus a held-out eval split, a BPE tokenizer and mixing specs.
"""

from omniscale.tools.demo.dataset import Plan, build, generate, scale_plan

__all__ = ["Plan", "build", "generate", "scale_plan"]
