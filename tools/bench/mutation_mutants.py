"""Cosmic Ray's mutants of a module (``tools/bench/mutation.py``): every one its argument-free
operators make outside postponed annotations, a seeded sample spread over the code sites, and
each applied to the source or shown as the changed lines."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import random


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One Cosmic Ray mutation: ``occurrence`` counts the operator's positions in the file."""

    file: str  # relative to the repository
    operator: str
    occurrence: int
    line: int
    column: int


def enumerate_mutants(source: str, file: str) -> list[Mutant]:
    """Every mutation Cosmic Ray's argument-free operators make in ``source``, but those inside
    annotations of a module with ``from __future__ import annotations``: Python never
    evaluates them there (``-> str | None`` made ``-> str & None`` is equivalent)."""
    from cosmic_ray import plugins
    from cosmic_ray.ast import ast_nodes, get_ast

    tree = get_ast(source)
    skipped = _annotation_spans(tree) if _postponed_annotations(source) else []
    mutants = []
    for name in plugins.operator_names():
        operator_class = plugins.get_operator(name)
        if operator_class.arguments():  # VariableReplacer/Inserter: need per-run arguments
            continue
        operator = operator_class()
        positions = (start for node in ast_nodes(tree)
                     for start, _ in operator.mutation_positions(node))
        mutants += [Mutant(file, name, i, line, column)
                    for i, (line, column) in enumerate(positions)
                    if not any(start <= (line, column) < end for start, end in skipped)]
    return mutants


def _postponed_annotations(source: str) -> bool:
    return any(isinstance(node, ast.ImportFrom) and node.module == "__future__"
               and any(alias.name == "annotations" for alias in node.names)
               for node in ast.parse(source).body)


def _annotation_spans(tree) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) of every annotation in a parso tree: parameters', returns', variables'."""
    from cosmic_ray.ast import ast_nodes

    spans = []
    for node in ast_nodes(tree):
        if node.type in ("funcdef", "param"):
            annotation = node.annotation
        elif node.type == "annassign":  # `: T` or `: T = value`
            annotation = node.children[1]
        else:
            continue
        if annotation is not None:
            spans.append((annotation.start_pos, annotation.end_pos))
    return spans


def sample(mutants: list[Mutant], limit: int, seed: int) -> list[Mutant]:
    """At most ``limit`` mutants, the same ones for the same seed: code sites (line, column)
    in a seeded order, one mutant from each before any gets a second, so a sample spreads
    over the module instead of following where operators pile up (a ``/`` has 12 swaps)."""
    if len(mutants) <= limit:
        return sorted(mutants, key=_order)
    rng = random.Random(f"{seed}:{mutants[0].file}")  # a str seed: the same in every process
    sites: dict[tuple[int, int], list[Mutant]] = {}
    for m in sorted(mutants, key=_order):
        sites.setdefault((m.line, m.column), []).append(m)
    queues = list(sites.values())
    rng.shuffle(queues)
    for queue in queues:
        rng.shuffle(queue)
    picked: list[Mutant] = []
    while len(picked) < limit:
        for queue in queues:
            if queue and len(picked) < limit:
                picked.append(queue.pop())
    return sorted(picked, key=_order)


def _order(m: Mutant) -> tuple:
    return m.line, m.column, m.operator, m.occurrence


def mutate(source: str, mutant: Mutant) -> str:
    from cosmic_ray import plugins
    from cosmic_ray.mutating import mutate_code

    mutated = mutate_code(source, plugins.get_operator(mutant.operator)(), mutant.occurrence)
    if mutated is None:
        raise ValueError(f"{mutant} is not a mutation of this source")
    return mutated


def line_diff(original: str, mutated: str) -> str:
    """The changed lines only (``-`` old, ``+`` new), as survivors are read."""
    return "\n".join(line for line in difflib.unified_diff(
        original.splitlines(), mutated.splitlines(), lineterm="", n=0)
        if line[:1] in "-+" and not line.startswith(("---", "+++")))
