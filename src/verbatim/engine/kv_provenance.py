"""Which weights computed the KV a request reused: per cache salt, the writers of each cached block.

vLLM keys a cached block by a hash chain over the salt and every token up to the block's end, serves a
prompt's longest run of cached leading blocks (never its last token: with a prompt that is all cached it
recomputes the last block) and, when two copies of a block exist, serves the one cached first.
:class:`KvProvenance` mirrors that keying on the engine's side: every completion records, for each full
block whose KV it computed, the versions that computed it; a later request that reports ``cached_tokens``
reused the leading ``cached_tokens // block_size`` blocks of its own prompt, and their records name the
versions of the KV it read.

What cannot be seen from outside vLLM, and what is recorded then:

* A second copy of a block (the recomputed last block of an all-cached prompt, generated tokens equal to
  ones already cached, blocks after a prompt's first miss) may or may not sit beside a live older copy,
  and vLLM serves the older one while it lives. Such a block keeps every copy's versions, and a read
  reports all of them. The first block a prompt missed is different: vLLM looked for it and found no
  copy, so earlier records of it are dropped.
* A reused block with no record (its writer's output was not yet processed, or the record was dropped to
  bound memory) makes the read unknown; the engine then reports every version it served since the last
  flush, a superset.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from verbatim.prefix_cache import cacheable_blocks, computed_tokens, full_blocks, token_block_keys

DEFAULT_LIMIT_BLOCKS = 65536
"""Blocks remembered when the engine's cache size is unknown (the oldest records go first)."""


class BlockWrite(NamedTuple):
    """One full block whose KV a request computed."""

    index: int
    versions: frozenset[int]
    vllm_missed: bool
    """vLLM looked the block up for this request and found no copy: any earlier record of it is stale."""


def computed_blocks(prompt_len: int, cached_tokens: int, versions: Sequence[int] | np.ndarray, block_size: int,
                    recomputed_before: int | None = None) -> list[BlockWrite]:
    """The full blocks a finished request computed, with the versions that computed each.

    The prompt's uncached part is prefilled in the step that samples token 0 (the engine does not chunk
    prefills unless ``max_num_batched_tokens`` is set below the context length),
    so with ``versions[0]``; the KV of generated token i is computed in the step that samples token i+1,
    so with ``versions[i+1]``; the last token's KV is never computed. ``recomputed_before=s`` says a cache
    flush reset the request before it sampled token s: it then recomputed everything before it (prompt
    and tokens 0..s-1) with ``versions[s]``.
    """
    versions = np.asarray(versions, dtype=np.int64).reshape(-1)
    n = len(versions)
    if n == 0:
        return []
    computed = np.empty(computed_tokens(prompt_len, n), dtype=np.int64)
    computed[:prompt_len] = versions[0]
    computed[prompt_len:] = versions[1:]
    start = cached_tokens
    if recomputed_before is not None:
        s = min(recomputed_before, n - 1)
        computed[:prompt_len + s] = versions[s]
        start = 0
    first = -(-start // block_size)
    looked_up = cacheable_blocks(prompt_len, block_size)  # vLLM searches the blocks within prompt_len - 1 tokens
    return [BlockWrite(j, frozenset(int(v) for v in np.unique(computed[j * block_size:(j + 1) * block_size])),
                       recomputed_before is None and j == first and j < looked_up)
            for j in range(first, full_blocks(len(computed), block_size))]


class KvProvenance:
    """Per cache salt, the versions that computed each cached block, since the last flush."""

    def __init__(self, block_size: int, version: int = 0, limit_blocks: int = DEFAULT_LIMIT_BLOCKS) -> None:
        self.block_size = block_size
        self.limit_blocks = limit_blocks
        self.epoch = 0
        """Counts flushes: a record made in an older epoch is gone."""
        self.flushed_at = version
        """The version the engine ran from the latest flush on (its start version before any flush)."""
        self._served: dict[int, set[int]] = {0: {version}}
        self._copies: OrderedDict[tuple[str | None, bytes], list[tuple[str, frozenset[int]]]] = OrderedDict()

    def serve(self, version: int) -> None:
        """The engine now runs ``version`` (a weight update that kept the cache)."""
        self._served[self.epoch].add(version)

    def flush(self, version: int) -> None:
        """The cache was emptied; the engine runs ``version`` from now on."""
        self.epoch += 1
        self.flushed_at = version
        self._served[self.epoch] = {version}
        self._copies.clear()

    def served(self, epoch: int) -> frozenset[int]:
        """Every version the engine ran during ``epoch``: the fallback for a read that cannot be resolved."""
        return frozenset(self._served.get(epoch, ()))

    def record(self, salt: str | None, tokens: Sequence[int] | np.ndarray, writer: str,
               writes: Sequence[BlockWrite]) -> None:
        """``writer`` computed these blocks of ``tokens`` (recording the same writer again replaces its copy)."""
        if not writes:
            return
        keys = token_block_keys(tokens, self.block_size, max(w.index for w in writes) + 1)
        for write in writes:
            if write.index >= len(keys):
                continue
            key = (salt, keys[write.index])
            copies = list(self._copies.get(key, ()))
            mine = [i for i, (other, _) in enumerate(copies) if other == writer]
            if mine:
                copies[mine[0]] = (writer, write.versions)
            elif write.vllm_missed:
                copies = [(writer, write.versions)]
            else:
                copies.append((writer, write.versions))
            self._copies[key] = copies
            self._copies.move_to_end(key)
        while len(self._copies) > self.limit_blocks:
            self._copies.popitem(last=False)

    def reused(self, salt: str | None, tokens: Sequence[int] | np.ndarray,
               cached_tokens: int) -> frozenset[int] | None:
        """The versions that computed the leading ``cached_tokens`` of ``tokens``; None if a block has no record."""
        found: set[int] = set()
        for key in token_block_keys(tokens, self.block_size, cached_tokens // self.block_size):
            copies = self._copies.get((salt, key))
            if not copies:
                return None
            self._copies.move_to_end((salt, key))
            for _, versions in copies:
                found |= versions
        return frozenset(found)

    def finish(self, salt: str | None, prompt: Sequence[int] | np.ndarray, token_ids: np.ndarray,
               versions: np.ndarray, cached_tokens: int, writer: str, epoch: int) -> tuple[int, ...]:
        """For an engine that sees a request only once it ended, and never runs one across an update:
        name the versions of the KV it reused (a superset if unknown), then record what it computed.

        ``epoch`` is the epoch at submission: after a flush since, its records and its blocks are gone.
        A ``cached_tokens`` off the block grid means the server's block size is not ``block_size``.
        """
        if not cached_tokens:
            reads: frozenset[int] | None = frozenset()
        elif epoch != self.epoch or cached_tokens % self.block_size:
            reads = None
        else:
            reads = self.reused(salt, prompt, cached_tokens)
        if epoch == self.epoch and cached_tokens % self.block_size == 0:
            self.record(salt, np.concatenate([np.asarray(prompt, dtype=np.int64), token_ids]), writer,
                        computed_blocks(len(prompt), cached_tokens, versions, self.block_size))
        return tuple(sorted(self.served(epoch) if reads is None else reads))
