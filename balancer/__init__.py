"""Compute-aware planning: cost model, packing, rank assignment, grouped reordering.

Pure array code (numpy, numba): no I/O, no torch."""
