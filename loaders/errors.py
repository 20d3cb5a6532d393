"""Errors of the trainer-side data path."""

from __future__ import annotations

from omniscale.errors import UserError


class CorruptSample(UserError):
    """A sample that cannot be read or decoded: a bad member, a stale byte range, a bad file.

    Carries the sample's identity so a ``skip`` policy can quarantine it and a ``fail`` policy
    can stop with one line, ``source/key: reason``.
    """

    def __init__(self, source: str, key: str, reason: str) -> None:
        self.source, self.key = source, key
        # Library messages may span lines; the contract is one line.
        self.reason = " ".join(str(reason).split()) or "corrupt"
        super().__init__(f"{source}/{key}: {self.reason}")

    def __reduce__(self):
        # Crossing a worker-process boundary must keep the three fields.
        return (type(self), (self.source, self.key, self.reason))
