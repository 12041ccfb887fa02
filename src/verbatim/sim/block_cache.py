"""A replica's prefix cache, as the simulator models it: a finite pool of hashed full blocks, LRU eviction.

The pure rules (whole blocks, the hash chain, the last prompt token always computed)
are :mod:`verbatim.prefix_cache`'s; this module is the stateful pool beside them.
The model follows the documented behaviour of vLLM's v1 prefix cache (automatic
prefix caching): the KV cache is cut into blocks of ``block_size`` tokens; a *full*
block is identified by a hash of its parent block's hash, its token ids and extra
keys (here: the cache salt), so equal hashes mean equal prefixes; a request's cache
hit is the longest run of its leading full blocks that are present; at least one
prompt token is always computed, so a prompt that is entirely cached still
recomputes its last block; blocks held by running requests are never evicted; when a
request finishes its blocks become evictable, tail block first, and eviction takes
the least recently freed block.

Simplifications (stated, not hidden): a request reserves all the blocks it will use
(prompt plus completion) when it is scheduled, where vLLM grows its allocation one
block at a time and may preempt; a full block that another request already
registered under the same hash is kept as a private duplicate rather than merged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from verbatim.prefix_cache import cacheable_blocks


@dataclass
class Allocation:
    """The blocks one running request holds: a hash per registered block, ``None`` per private block."""

    blocks: list[int | None] = field(default_factory=list)
    registered: int = 0
    """How many leading entries are the request's full prompt blocks (hit or newly registered)."""


class BlockCache:
    """Finite block pool of one replica; ``capacity`` blocks of ``block_size`` tokens."""

    def __init__(self, capacity: int, block_size: int) -> None:
        if capacity < 1 or block_size < 1:
            raise ValueError("a block cache needs at least one block of at least one token")
        self.capacity, self.block_size = capacity, block_size
        self._refs: dict[int, int] = {}
        """Registered blocks held by running requests, with their holder counts."""
        self._free: OrderedDict[int, None] = OrderedDict()
        """Registered blocks nobody holds, least recently freed first (the eviction order)."""
        self.in_use = 0
        """Blocks held by running requests (registered or private)."""
        self.evictions = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._refs or block_hash in self._free

    @property
    def cached_blocks(self) -> int:
        return len(self._refs) + len(self._free)

    def free_order(self) -> list[int]:
        """Evictable blocks, next victim first."""
        return list(self._free)

    def hit_blocks(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """Leading blocks of this prompt that are cached (the longest present chain)."""
        refs, free = self._refs, self._free
        limit = min(len(hashes), cacheable_blocks(prompt_tokens, self.block_size))
        for n in range(limit):
            h = hashes[n]
            if h not in refs and h not in free:
                return n
        return limit

    def fits(self, total_blocks: int, prompt_tokens: int) -> bool:
        """Could a request of this size be held now, if all of its cacheable blocks were hits? (a cheap bound)"""
        best_hit = cacheable_blocks(prompt_tokens, self.block_size)
        return self.capacity - self.in_use >= total_blocks - best_hit

    def allocate(self, hashes: Sequence[int], hit: int, prompt_blocks: int, total_blocks: int) -> Allocation | None:
        """Hold ``total_blocks`` for a request: its first ``hit`` blocks from the cache, the rest new.

        The new full prompt blocks ``hashes[hit:prompt_blocks]`` are registered at once, so a request
        scheduled after this one hits them. ``None`` (and nothing changed) when the pool is too full.
        """
        refs, free = self._refs, self._free
        reused = hashes[:hit]
        revived = sum(1 for h in reused if h in free)
        new = total_blocks - hit
        if self.capacity - self.in_use - revived < new:
            return None
        for h in reused:
            if h in free:
                del free[h]
                refs[h] = 1
            else:
                refs[h] += 1
        self.in_use += revived
        self._make_room(new)
        self.in_use += new
        blocks: list[int | None] = list(reused)
        for h in hashes[hit:prompt_blocks]:  # register each new full block (inlined _claim: the hot path)
            if h in refs or h in free:
                blocks.append(None)
            else:
                refs[h] = 1
                blocks.append(h)
        blocks.extend([None] * (total_blocks - len(blocks)))
        return Allocation(blocks, registered=prompt_blocks)

    def release(self, allocation: Allocation, hashes: Sequence[int], computed_blocks: int) -> None:
        """A request finished: register the blocks its completion filled, then free all, tail first."""
        blocks, refs, free = allocation.blocks, self._refs, self._free
        for i in range(allocation.registered, min(computed_blocks, len(blocks), len(hashes))):
            if blocks[i] is None:
                blocks[i] = self._claim(hashes[i])
        freed = 0
        for h in reversed(blocks):
            if h is None:
                freed += 1
                continue
            left = refs[h] - 1
            if left:
                refs[h] = left
            else:
                del refs[h]
                free[h] = None
                freed += 1
        self.in_use -= freed
        blocks.clear()

    def _claim(self, block_hash: int) -> int | None:
        """Register a newly computed block under its hash (a private duplicate if already registered)."""
        if block_hash in self._refs or block_hash in self._free:
            return None
        self._refs[block_hash] = 1
        return block_hash

    def _make_room(self, new: int) -> None:
        free = self._free
        evict = min(new - (self.capacity - self.in_use - len(free)), len(free))
        for _ in range(evict):
            free.popitem(last=False)
        self.evictions += max(evict, 0)
