"""Parallelism applied from outside: named mesh, apply_* functions, collectives, checkpoints."""
