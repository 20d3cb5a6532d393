"""Conversation importers: ``omniscale data import FORMAT SRC --out DIR``.

Each format has its module (:mod:`.openai`, :mod:`.sharegpt`, :mod:`.llava`) turning one record
into a conversation in the form of :mod:`omniscale.loaders.conversation` plus its media
references; :mod:`.media` fetches those, :mod:`.convert` writes one input file's shards and
:mod:`.run` runs an import over many files, resumably.
"""

from __future__ import annotations

from omniscale.loaders.importers.convert import FORMATS
from omniscale.loaders.importers.run import ImportReport, import_conversations

__all__ = ["FORMATS", "ImportReport", "import_conversations"]
