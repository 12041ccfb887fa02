"""The append-only token ledger of one rollout.

A rollout is one token sequence that only ever grows: the rendered prompt, then
for each turn the completion exactly as sampled and the rendered observation. An agent
that rewrites its history starts a new *segment* (:meth:`Ledger.start_segment`): a fresh
prompt appended after everything recorded, which the following turns extend; nothing
recorded before it changes.
Per-token columns are NumPy arrays with amortised O(1) appends; ``view()``
hands out read-only views (no copy), so the next turn's prompt is the ledger
itself. Nothing can overwrite or drop a token once appended.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from verbatim.datamodel import (
    COLUMN_DTYPES,
    EXPERT_DTYPE,
    NO_EXPERT,
    Completion,
    Rollout,
    Source,
    TokenColumns,
    Turn,
    TurnSampling,
)
from verbatim.errors import LedgerError

_NOT_SAMPLED_LOGPROB = np.float32(np.nan)
_NOT_SAMPLED_VERSION = -1
_MAX_TURNS = int(np.iinfo(np.int16).max)


def _locked(array: np.ndarray) -> np.ndarray:
    """Buffers are read-only at rest; only ``Ledger._append`` unlocks them, past the end."""
    array.flags.writeable = False
    return array


class Ledger:
    """Append-only per-token columns plus the turn records of one rollout."""

    __slots__ = ("_buffers", "_size", "_turns", "_segment_start", "_experts")

    def __init__(self, capacity: int = 256) -> None:
        capacity = max(int(capacity), 16)
        self._buffers = {name: _locked(np.empty(capacity, dtype)) for name, dtype in COLUMN_DTYPES.items()}
        self._size = 0
        self._turns: list[Turn] = []
        self._segment_start = 0
        self._experts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        """Each segment's routed experts, from its newest completion that carried them (whose prompt is the whole
        segment so far: it covers what earlier turns' did, as the engine last computed or cached them)."""

    # -- reading --------------------------------------------------------------

    def __len__(self) -> int:
        return self._size

    @property
    def turns(self) -> tuple[Turn, ...]:
        return tuple(self._turns)

    def column(self, name: str) -> np.ndarray:
        """A read-only view of one column (no copy)."""
        view = self._buffers[name][: self._size]
        view.flags.writeable = False
        return view

    @property
    def segment_start(self) -> int:
        """Where the current segment's tokens begin (0 until an agent rewrites its history)."""
        return self._segment_start

    def view(self) -> np.ndarray:
        """The current segment's tokens so far (the whole sequence unless a segment was started), read-only and
        without a copy: the next prompt."""
        return self.column("token_id")[self._segment_start:]

    def columns(self) -> TokenColumns:
        """A snapshot of all columns (copied once, read-only)."""
        experts, versions = self.routed_experts()
        return TokenColumns(**{name: self._buffers[name][: self._size].copy() for name in COLUMN_DTYPES},
                            routed_experts=experts, experts_version=versions)

    def routed_experts(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Every token's routed experts (``NO_EXPERT`` where the engine never fed it) and the version that computed
        them (−1 there), where completions carried them."""
        if not self._experts:
            return None, None
        first, _ = next(iter(self._experts.values()))
        experts = np.full((self._size, *first.shape[1:]), NO_EXPERT, EXPERT_DTYPE)
        versions = np.full(self._size, -1, np.int32)
        for start, (segment, computed_by) in self._experts.items():
            experts[start:start + len(segment)] = segment
            versions[start:start + len(segment)] = computed_by
        return experts, versions

    # -- appending --------------------------------------------------------------

    def append_prompt(self, token_ids: Any) -> None:
        """Append the initial rendered prompt (only before the first completion)."""
        if self._turns:
            raise LedgerError("prompt tokens can only be appended before the first completion")
        self._append(token_ids, Source.PROMPT)

    def start_segment(self, token_ids: Any) -> int:
        """Begin a new segment with a freshly rendered prompt (after at least one completion); the next
        completion is sampled for it alone. Returns where the segment starts."""
        if not self._turns or self._turns[-1].completion_end != self._size:
            raise LedgerError("a new segment starts right after a completion")
        start = self._size
        self._append(token_ids, Source.PROMPT)
        self._segment_start = start
        return start

    def append_observation(self, token_ids: Any) -> None:
        """Append rendered environment tokens (observation + next generation prompt)."""
        if not self._turns:
            raise LedgerError("observation tokens need a completion before them; use append_prompt")
        self._append(token_ids, Source.ENV)

    def append_completion(self, completion: Completion, *, reward: float | None = None,
                          sampling: TurnSampling | None = None) -> Turn:
        """Append a completion exactly as sampled and record its turn (with the settings it was sampled at)."""
        if self._size == 0:
            raise LedgerError("a completion needs a prompt before it")
        if completion.prompt_tokens != self._size - self._segment_start:
            raise LedgerError(
                f"completion was sampled for a {completion.prompt_tokens}-token prompt, "
                f"but the ledger holds {self._size - self._segment_start} tokens"
                + (f" in its segment from {self._segment_start}" if self._segment_start else "")
            )
        if len(self._turns) >= _MAX_TURNS:
            raise LedgerError(f"a rollout holds at most {_MAX_TURNS} turns")
        versions = completion.versions
        if len(versions) and int(versions.min()) < 0:
            raise LedgerError("every sampled token needs a policy version >= 0")
        if len(completion.logprobs) and not np.isfinite(completion.logprobs).all():
            raise LedgerError("every sampled token needs a finite sampler logprob")
        experts = completion.routed_experts
        if experts is not None and len(experts) > completion.prompt_tokens + len(completion.token_ids):
            raise LedgerError(f"the completion's routed experts cover {len(experts)} tokens, more than its "
                              f"{completion.prompt_tokens + len(completion.token_ids)}")
        prompt_end = self._size
        self._append(completion.token_ids, Source.MODEL, completion.logprobs, versions)
        if experts is not None:
            self._experts[self._segment_start] = (experts, completion.experts_version)
        turn = Turn(
            index=len(self._turns),
            prompt_start=self._segment_start,
            prompt_end=prompt_end,
            completion_end=self._size,
            cached_tokens=completion.cached_tokens,
            cache_salt=completion.cache_salt,
            finish_reason=completion.finish_reason,
            kv_versions=completion.kv_versions,
            queue_s=completion.queue_s,
            first_token_s=completion.first_token_s,
            total_s=completion.total_s,
            reward=reward,
            replica=completion.replica,
            admission_wait_s=completion.admission_wait_s,
            sampling=sampling,
        )
        self._turns.append(turn)
        return turn

    def set_turn_reward(self, reward: float) -> Turn:
        """Attach the reward for the last turn (rewards arrive after the env step)."""
        if not self._turns:
            raise LedgerError("no turn to reward yet")
        last = self._turns[-1]
        if last.reward is not None:
            raise LedgerError(f"turn {last.index} already has a reward")
        self._turns[-1] = last.model_copy(update={"reward": float(reward)})
        return self._turns[-1]

    def to_rollout(self, **fields: Any) -> Rollout:
        """Freeze the ledger into a :class:`Rollout` trace record."""
        return Rollout(tokens=self.columns(), turns=self.turns, **fields)

    # -- internals ----------------------------------------------------------------

    def _append(self, token_ids: Any, source: Source,
                logprobs: Any = None, versions: Any = None) -> None:
        ids = np.asarray(token_ids)
        if ids.ndim != 1:
            ids = ids.reshape(-1)
        if ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0
                         or ids.max() > np.iinfo(np.int32).max):
            raise LedgerError("token ids must be non-negative 32-bit integers")
        n = int(ids.size)
        self._reserve(self._size + n)
        start, end = self._size, self._size + n
        b = self._buffers
        for buffer in b.values():
            buffer.flags.writeable = True
        b["token_id"][start:end] = ids
        b["source"][start:end] = int(source)
        b["turn"][start:end] = len(self._turns)
        if logprobs is None:
            b["logprob"][start:end] = _NOT_SAMPLED_LOGPROB
            b["policy_version"][start:end] = _NOT_SAMPLED_VERSION
        else:
            b["logprob"][start:end] = logprobs
            b["policy_version"][start:end] = versions
        for buffer in b.values():
            buffer.flags.writeable = False
        self._size = end

    def _reserve(self, needed: int) -> None:
        capacity = len(self._buffers["token_id"])
        if needed <= capacity:
            return
        while capacity < needed:
            capacity *= 2
        for name, old in self._buffers.items():
            new = np.empty(capacity, old.dtype)
            new[: self._size] = old[: self._size]
            self._buffers[name] = _locked(new)
