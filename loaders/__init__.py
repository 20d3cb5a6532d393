"""Trainer-side data path: source formats, the source index, decoders, packed batches."""
