"""The arithmetic of an automatic prefix cache, in one place: pure functions, no engine, no state.

Every layer that reasons about what a prefix cache could serve asks this module:
the trace lint (what a turn should have found cached), the group lint, the run
summary (the least prefill any cache must do), the router and the simulator
(how much context a session shares with its group), and the simulator's block
pool (the hash chain that names blocks). The rules, as vLLM's prefix cache
applies them:

* **whole blocks** — the KV cache is cut into blocks of ``block_size`` tokens
  and only a *full* block is cached and served; a trailing partial block never is.
* **the last prompt token is always computed** — the engine needs its logits, so
  at most ``prompt − 1`` prompt tokens can come from the cache
  (:func:`cacheable_blocks`).
* **what a request computed** — the KV of its prompt and of every sampled token
  but the last (the last one is returned, never fed back): :func:`computed_tokens`.
* **reusable prefix** — a later prompt can find cached the tokens it shares with
  what was computed before, capped at ``prompt − 1``, in whole blocks
  (:func:`reusable_tokens`, :func:`reusable_prefix` for consecutive turns).
* **groups** — the members of a group open with a shared prompt; it is prefilled
  once, by the group's first request, and every other member finds it cached
  (:func:`group_reusable`, :data:`GROUP_PREFILLS`).
* **minimum prefill** — taking requests in order, the tokens no cache of any block
  size could have served: a true lower bound on real prefill (design invariant 5,
  :func:`min_prefill`).
* **block hashes** — a full block is named by a hash of its parent block's hash,
  its tokens and the cache salt, so equal hashes mean equal prefixes
  (:func:`chain_hashes`, :func:`token_block_hashes`; :func:`token_block_keys` for
  exact keys of real token data).

The block size itself is the engine's (``Engine.block_size``), recorded in a run's
manifest under ``engine.block_size``; nothing here assumes one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the trainer imports common_prefix on machines with torch alone (scripts/gpu_probe.py)
    from verbatim.datamodel import Turn

GROUP_PREFILLS = 1
"""How many members of a group may prefill the group's shared prompt: its first request alone."""

_ROOT = 0x5EED
"""The parent "hash" of a sequence's first block."""


# ---------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------


def full_blocks(tokens: int, block_size: int) -> int:
    """How many full blocks ``tokens`` tokens fill (a trailing partial block does not count)."""
    return max(tokens, 0) // block_size


def whole_blocks(tokens: int, block_size: int) -> int:
    """``tokens`` rounded down to whole blocks, in tokens: what a block cache can hold of them."""
    return full_blocks(tokens, block_size) * block_size


def cacheable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Leading full blocks a prompt may take from the cache (its last token is always computed)."""
    return full_blocks(prompt_tokens - 1, block_size)


def computed_tokens(prompt_tokens: int, completion_tokens: int) -> int:
    """Tokens whose KV a request computed: its prompt and every sampled token but the last."""
    return prompt_tokens + completion_tokens - 1 if completion_tokens else prompt_tokens


# ---------------------------------------------------------------------------
# Reusable prefixes
# ---------------------------------------------------------------------------


def reusable_tokens(known: int, prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens a cache can serve when the prompt's first ``known`` tokens were computed before.

    ``min(known, prompt − 1)`` rounded down to whole blocks.
    """
    return whole_blocks(min(known, prompt_tokens - 1), block_size)


def reusable_prefix(previous: Turn, turn: Turn, block_size: int) -> int:
    """Prompt tokens of ``turn`` the cache should hold after ``previous`` (the turn before, same rollout).

    ``turn``'s prompt extends ``previous``'s whole sequence, so everything ``previous``
    computed is a prefix of it.
    """
    computed = computed_tokens(previous.prompt_end, previous.completion_tokens)
    return reusable_tokens(computed, turn.prompt_end, block_size)


def shared_prefix(a: Any, b: Any) -> int:
    """Length of the longest common prefix of two token arrays."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def common_prefix(sequences: Sequence[Any]) -> int:
    """Length of the prefix every one of ``sequences`` has in common (the whole of a lone sequence)."""
    first = sequences[0]
    return min((shared_prefix(first, other) for other in sequences[1:]), default=len(first))


def group_reusable(prompt: Any, others: Iterable[Any], block_size: int) -> int:
    """First-prompt tokens a group member can find cached once the others' first requests were prefilled."""
    longest = max((shared_prefix(prompt, other) for other in others), default=0)
    return reusable_tokens(longest, len(prompt), block_size)


def group_prefilled_once(misses: int) -> bool:
    """Did a group's members prefill its shared prompt no more often than its first request must?"""
    return misses <= GROUP_PREFILLS


# ---------------------------------------------------------------------------
# The least prefill
# ---------------------------------------------------------------------------


def min_prefill(requests: Iterable[tuple[Sequence[int], Sequence[int]]]) -> int:
    """Least prefill for ``(prompt, completion)`` requests in the order sent.

    A prompt token needs prefilling unless its prefix was already computed: as part of
    an earlier prompt, or while decoding an earlier completion (every sampled token but
    the last). Every request prefills at least one token (the engine needs the last
    prompt token's logits). A block cache can only do worse: it loses partial blocks
    and whatever it evicted.
    """
    computed: set[int] = set()
    total = 0
    for prompt, completion in requests:
        key, new = 0, 0
        for token in prompt:
            key = hash((key, int(token)))
            if key not in computed:
                computed.add(key)
                new += 1
        total += max(new, 1)
        for token in list(completion)[:-1]:  # decoding computes the KV of every sampled token but the last
            key = hash((key, int(token)))
            computed.add(key)
    return total


# ---------------------------------------------------------------------------
# Block hashes
# ---------------------------------------------------------------------------


def chain_hashes(keys: Iterable[object], salt: int = 0) -> list[int]:
    """Block hashes of a sequence whose full blocks have these content keys, each chained to its parent."""
    hashes, parent = [], _ROOT
    for key in keys:
        parent = hash((parent, key, salt))
        hashes.append(parent)
    return hashes


def token_block_hashes(token_ids: Any, block_size: int, salt: int = 0) -> list[int]:
    """Hashes of the full blocks of a real token sequence (a trailing partial block has none)."""
    full = full_blocks(len(token_ids), block_size)
    rows = np.asarray(token_ids[:full * block_size], dtype=np.int64).reshape(full, block_size)
    return chain_hashes((tuple(row) for row in rows.tolist()), salt)


def token_block_keys(tokens: Any, block_size: int, count: int | None = None) -> list[bytes]:
    """Collision-resistant hash-chain keys of the first ``count`` full blocks (all when None).

    Key i names ``tokens[:(i+1)·B]`` exactly (a 128-bit digest chained over the token bytes), for
    bookkeeping about real token data (which weights computed a block: ``engine/kv_provenance.py``);
    :func:`token_block_hashes` is the cheap form the simulator uses.
    """
    array = np.asarray(tokens, dtype=np.int64).reshape(-1)
    full = len(array) // block_size if count is None else min(count, len(array) // block_size)
    keys, parent = [], b""
    for i in range(full):
        parent = hashlib.blake2b(parent + array[i * block_size:(i + 1) * block_size].tobytes(),
                                 digest_size=16).digest()
        keys.append(parent)
    return keys
