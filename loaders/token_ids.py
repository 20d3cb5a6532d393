"""Token ids by reference: the index tokenized every text once, the loaders read the ids back.

``omniscale data index`` encodes each sample's text to count its tokens and keeps the ids in
the index's ``text_ids`` column (``omniscale.index_schema``); a worker reads one shard's ids at a
time (its row group, that column and the keys) and looks samples up by key, keeping a few
shards (least recently used dropped), like the reader keeps open shards. Tokenizing a long
document costs about a millisecond per kilobyte; reading its ids back costs next to nothing.

The ids are only good for the tokenizer that made them: the index records its sha256, and a
loader whose tokenizer differs refuses to start (:func:`check_tokenizer`), since the index's
token counts -- what the plane budgets with -- would be wrong too. A source whose index has
no ids (written by a hand-made ref, or a sample without a row) is tokenized as before.

Indexes are found by Location: a local directory, or a URL in an object store (the spec's
``index_dir`` may put them apart from the shards).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np

from omniscale.errors import UserError
from omniscale.index_schema import index_path, read_index_metadata, read_shard
from omniscale.layout import DEFAULT_SPECIAL_TOKENS, SpecialTokens
from omniscale.loaders.text_cost import tokenizer_fingerprint
from omniscale.location import Location
from omniscale.refs import SampleRef

MAX_SHARDS = 16  # shards whose ids a worker keeps


def check_tokenizer(sources: "dict[str, str | Path | Location]", tokenizer: str | Path,
                    special: SpecialTokens = DEFAULT_SPECIAL_TOKENS) -> None:
    """A UserError naming the first source indexed with another tokenizer than ``tokenizer``,
    or other special tokens than ``special`` (an index without a recorded tokenizer
    passes). ``sources``: where each source's index is."""
    mine = tokenizer_fingerprint(tokenizer)
    for name, where in sources.items():
        path = Location.of(where)
        meta = read_index_metadata(path)
        theirs = meta.get("tokenizer_sha256")
        if theirs is not None and theirs != mine:
            raise UserError(f"{index_path(path)}: source {name!r} was indexed with another "
                            f"tokenizer (sha256 {theirs[:12]}…) than this run's {tokenizer} "
                            f"({mine[:12]}…); re-run `omniscale data index` with it")
        named = SpecialTokens(**meta.get("special_tokens", {}))
        if theirs is not None and named != special:
            raise UserError(f"{index_path(path)}: source {name!r} was indexed with special "
                            f"tokens {named.names()}, this run's spec names {special.names()}; "
                            "re-run `omniscale data index` on the spec")


class TokenIds:
    """The index's token ids of named sources' samples; one per worker (not thread-safe)."""

    def __init__(self, sources: "dict[str, str | Path | Location]",
                 max_shards: int = MAX_SHARDS) -> None:
        # where each source's index is (its directory, or its ``index_dir`` entry)
        self._roots = {name: Location.of(where) for name, where in sources.items()}
        self._meta: OrderedDict[str, dict] = OrderedDict()  # bounded too: 1,000s of sources
        self._shards: OrderedDict[tuple[str, str], dict[str, list | None]] = OrderedDict()
        self._max = max_shards

    def get(self, ref: SampleRef) -> np.ndarray | None:
        """The ref's text token ids (int64), or None when the index has none for it."""
        shard = self._shard(ref)
        return shard.get(ref.key) if shard is not None else None

    def targets(self, ref: SampleRef) -> np.ndarray | None:
        """A conversation sample's target token ranges (flat [start, end) pairs into its
        ids), or None: every text token is a target, or the index has no ids for it."""
        shard = self._shard(ref)
        return shard.targets(ref.key) if shard is not None else None

    def chat(self, source: str) -> dict | None:
        """The chat template a conversation source was indexed with (``ChatFormat``'s
        dict), or None for any other source."""
        root = self._roots.get(source)
        return self._metadata(source, root).get("chat") if root is not None else None

    def _shard(self, ref: SampleRef) -> "_ShardIds | None":
        root = self._roots.get(ref.source)
        if root is None or not ref.shard:
            return None
        at = (ref.source, ref.shard)
        shard = self._shards.get(at)
        if shard is None:
            shard = self._shards[at] = self._load(ref.source, root, ref.shard)
            if len(self._shards) > self._max:
                self._shards.popitem(last=False)
        else:
            self._shards.move_to_end(at)
        return shard

    def _metadata(self, source: str, root: Location) -> dict:
        meta = self._meta.get(source)
        if meta is None:
            meta = self._meta[source] = read_index_metadata(root)
            if len(self._meta) > self._max:
                self._meta.popitem(last=False)
        else:
            self._meta.move_to_end(source)
        return meta

    def _load(self, source: str, root: Location, shard: str) -> "_ShardIds":
        meta = self._metadata(source, root)
        if shard not in meta.get("shards", {}) or meta.get("version", 0) < 3:
            return _ShardIds([], None)
        targets = meta.get("version", 0) >= 4
        table = read_shard(root, shard, meta,
                           columns=["key", "text_ids"] + (["text_targets"] if targets else []))
        return _ShardIds(table.column("key").to_pylist(),
                         table.column("text_ids").combine_chunks(),
                         table.column("text_targets").combine_chunks() if targets else None)


class _ShardIds:
    """One shard's ids (and conversation targets): a key's row, then its slice of the list
    column's values (no copy until the int64 conversion the sequence layout wants)."""

    def __init__(self, keys: list[str], column, targets=None) -> None:
        self.row = {key: i for i, key in enumerate(keys)}
        self.ids = _ListColumn(column) if column is not None else None
        self.target_ranges = _ListColumn(targets) if targets is not None else None

    def get(self, key: str) -> np.ndarray | None:
        i = self.row.get(key)
        return self.ids.get(i) if i is not None and self.ids is not None else None

    def targets(self, key: str) -> np.ndarray | None:
        i = self.row.get(key)
        if i is None or self.target_ranges is None:
            return None
        return self.target_ranges.get(i)


class _ListColumn:
    def __init__(self, column) -> None:
        self.valid = column.is_valid().to_numpy(zero_copy_only=False)
        self.offsets = column.offsets.to_numpy()
        self.values = column.values.to_numpy()

    def get(self, i: int) -> np.ndarray | None:
        if not self.valid[i]:
            return None
        return self.values[self.offsets[i]:self.offsets[i + 1]].astype(np.int64)
