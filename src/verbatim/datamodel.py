"""The pure data model every layer may import: messages, completions, turns, rollouts.

Nothing here does I/O or imports another verbatim layer. Token data lives in
NumPy columns (:class:`TokenColumns`); everything else is a small frozen type.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEMA_VERSION = 4
"""Version of the trace schema written by this code (rollouts and manifests).

1: first release. 2: turns record the replica that served them and the admission wait.
3: turns record their sampling settings (:class:`TurnSampling`), the distribution μ describes.
4: a rollout may hold several segments (an agent that rewrote its history): turns record where their
prompt starts (``Turn.prompt_start``), and ``info["segments"]`` says where and why each new one began.
Readers accept every version up to their own."""


class Frozen(BaseModel):
    """Base for trace types and configs: immutable, and unknown fields are an error; a field's docstring is its
    description (a config's flag help, :mod:`verbatim.jobs.flag_table`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


# ---------------------------------------------------------------------------
# Messages (what environments and renderers speak)
# ---------------------------------------------------------------------------

Role = Literal["system", "user", "assistant", "tool"]


class ToolCall(Frozen):
    """One tool call; ``raw`` keeps the exact text the model wrote, if parsed from tokens."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    id: str | None = None
    raw: str | None = None
    arguments_text: str | None = None
    """The arguments exactly as given when they came as a JSON string (OpenAI's ``function.arguments``),
    even when that string is malformed (then ``arguments`` is empty); renderers write it where the template does."""


class Message(Frozen):
    """A chat message. ``reasoning`` holds think blocks / analysis channels apart from content."""

    role: Role
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    problems: tuple[str, ...] = ()
    """What a parser found wrong (e.g. a malformed tool call); never raised."""


# ---------------------------------------------------------------------------
# Token columns
# ---------------------------------------------------------------------------


class Source(enum.IntEnum):
    """Who wrote a token. Model tokens are the loss mask."""

    PROMPT = 0
    ENV = 1
    MODEL = 2


COLUMN_DTYPES: dict[str, np.dtype] = {
    "token_id": np.dtype(np.int32),
    "source": np.dtype(np.int8),
    "logprob": np.dtype(np.float32),
    "policy_version": np.dtype(np.int32),
    "turn": np.dtype(np.int16),
}
"""The per-token columns of a rollout, in order, with their dtypes."""


def _readonly(values: Any, dtype: np.dtype) -> np.ndarray:
    array = np.array(values, dtype=dtype, copy=True).reshape(-1)
    array.flags.writeable = False
    return array


EXPERT_DTYPE = np.dtype(np.int16)
"""Expert ids as a trace keeps them (every released MoE has fewer than 32 768 experts)."""
NO_EXPERT = -1
"""A token-layer with no recorded expert: a token the engine never fed (a segment's last tokens)."""


def _experts(values: Any) -> np.ndarray:
    array = np.array(values, dtype=EXPERT_DTYPE, copy=True)
    if array.ndim != 3:
        raise ValueError(f"routed_experts must be tokens × MoE layers × k, not of shape {array.shape}")
    array.flags.writeable = False
    return array


@dataclass(frozen=True, eq=False)
class TokenColumns:
    """Aligned, read-only per-token columns of one rollout."""

    token_id: np.ndarray
    source: np.ndarray
    logprob: np.ndarray
    policy_version: np.ndarray
    turn: np.ndarray
    routed_experts: np.ndarray | None = None
    """Where the engine recorded them (a MoE model, ``--record-routing``): the experts its router chose for each
    token in each MoE layer, ``tokens × layers × k``, :data:`NO_EXPERT` where the token was never fed; the
    routing the trainer replays (docs/trainer.md, Rollout Routing Replay)."""
    experts_version: np.ndarray | None = None
    """With ``routed_experts``: the weights version that computed each token's experts (with its KV: a prompt
    token read from the prefix cache has its writer's), −1 where none."""

    def __post_init__(self) -> None:
        lengths = set()
        for name, dtype in COLUMN_DTYPES.items():
            column = getattr(self, name)
            if not (isinstance(column, np.ndarray) and column.dtype == dtype
                    and column.ndim == 1 and not column.flags.writeable):
                object.__setattr__(self, name, _readonly(column, dtype))
            lengths.add(len(getattr(self, name)))
        experts = self.routed_experts
        if experts is not None:
            if not (isinstance(experts, np.ndarray) and experts.dtype == EXPERT_DTYPE and experts.ndim == 3
                    and not experts.flags.writeable):
                object.__setattr__(self, "routed_experts", experts := _experts(experts))
            lengths.add(len(experts))
            versions = self.experts_version
            object.__setattr__(self, "experts_version", _readonly(
                np.full(len(experts), -1) if versions is None else versions, np.dtype(np.int32)))
            lengths.add(len(self.experts_version))
        elif self.experts_version is not None:
            raise ValueError("experts_version goes with routed_experts")
        if len(lengths) > 1:
            raise ValueError(f"token columns are not aligned: lengths {sorted(lengths)}")

    @classmethod
    def empty(cls) -> TokenColumns:
        return cls(**{name: np.empty(0, dtype) for name, dtype in COLUMN_DTYPES.items()})

    def __len__(self) -> int:
        return len(self.token_id)

    @property
    def loss_mask(self) -> np.ndarray:
        return self.source == Source.MODEL

    def as_dict(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in COLUMN_DTYPES}

    def equals(self, other: TokenColumns) -> bool:
        """Exact equality, NaN logprobs equal to NaN."""
        mine, theirs = self.routed_experts, other.routed_experts
        same_experts = mine is theirs is None or (mine is not None and theirs is not None
                                                  and np.array_equal(mine, theirs)
                                                  and np.array_equal(self.experts_version, other.experts_version))
        return same_experts and all(
            np.array_equal(getattr(self, n), getattr(other, n), equal_nan=(n == "logprob"))
            for n in COLUMN_DTYPES
        )

    def slice(self, start: int, stop: int) -> TokenColumns:
        """Tokens ``start … stop-1`` (views, no copy)."""
        experts = None if self.routed_experts is None else self.routed_experts[start:stop]
        versions = None if self.experts_version is None else self.experts_version[start:stop]
        return TokenColumns(**{name: column[start:stop] for name, column in self.as_dict().items()},
                            routed_experts=experts, experts_version=versions)


# ---------------------------------------------------------------------------
# Engine output
# ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Completion:
    """What the engine returns for one request: tokens in, tokens out, no text."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    cache_salt: str | None = None
    kv_versions: tuple[int, ...] = ()
    queue_s: float = 0.0
    first_token_s: float = 0.0
    total_s: float = 0.0
    replica: str | None = None
    """The replica that served the request (set by the router)."""
    admission_wait_s: float = 0.0
    """Time a new rollout's first request was held by admission control."""
    extra: dict[str, Any] = field(default_factory=dict)
    routed_experts: np.ndarray | None = None
    """Where the engine captured them (a MoE model): the experts its router chose for each token of the prompt and
    the completion but the last (never fed), ``tokens × MoE layers × k``, cached prompt tokens included
    (engine/expert_capture.py)."""
    experts_version: np.ndarray | None = None
    """The weights version that computed each of those tokens' experts (a cached token's: its KV writer's)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", _readonly(self.token_ids, COLUMN_DTYPES["token_id"]))
        object.__setattr__(self, "logprobs", _readonly(self.logprobs, COLUMN_DTYPES["logprob"]))
        object.__setattr__(self, "versions", _readonly(self.versions, COLUMN_DTYPES["policy_version"]))
        n = len(self.token_ids)
        if self.routed_experts is not None:
            object.__setattr__(self, "routed_experts", _experts(self.routed_experts))
            versions = np.full(len(self.routed_experts), -1) if self.experts_version is None else self.experts_version
            object.__setattr__(self, "experts_version", _readonly(versions, np.dtype(np.int32)))
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"completion columns are not aligned: {n} tokens, {len(self.logprobs)} logprobs, "
                f"{len(self.versions)} versions"
            )
        if not 0 <= self.cached_tokens <= self.prompt_tokens:
            raise ValueError(
                f"cached_tokens={self.cached_tokens} must lie in [0, prompt_tokens={self.prompt_tokens}]"
            )

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


# ---------------------------------------------------------------------------
# Turns and rollouts (the trace)
# ---------------------------------------------------------------------------


class TurnSampling(Frozen):
    """The sampling settings of one request: the distribution its sampler logprobs μ describe.

    ``logprobs`` says what the engine reported: ``processed`` is log μ of the distribution the token was
    drawn from (after temperature and the top-p/top-k masks: vLLM's ``processed_logprobs``), ``raw`` the
    model's plain log-softmax whatever the settings. At temperature 0 (greedy) vLLM applies no temperature,
    so μ is the plain log-softmax either way (:attr:`logprob_temperature` is 1).
    """

    temperature: float = Field(ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    """0: no top-k mask."""
    regex: str | None = None
    logprobs: Literal["processed", "raw"] = "processed"

    @property
    def truncated(self) -> bool:
        """Whether a mask removed tokens from μ's support (top-p < 1, top-k, a regex)."""
        return self.top_p < 1 or self.top_k > 0 or self.regex is not None

    @property
    def logprob_temperature(self) -> float:
        """The T of the log-softmax(logits / T) that μ holds: 1 for raw logprobs and for greedy requests."""
        return self.temperature if self.logprobs == "processed" and self.temperature > 0 else 1.0


UNRECORDED_SAMPLING = TurnSampling(temperature=1.0, logprobs="raw")
"""What a turn of a trace before schema 3 is taken to have been sampled with."""


class Turn(Frozen):
    """One request/response of a rollout, as offsets into the rollout's token columns.

    The turn's prompt is ``tokens[prompt_start:prompt_end]``; its completion is
    ``tokens[prompt_end:completion_end]``. ``prompt_start`` is 0 but in the later segments of a rollout
    whose agent rewrote its history (:meth:`Rollout.segments`).
    """

    index: int = Field(ge=0)
    prompt_start: int = Field(default=0, ge=0)
    prompt_end: int = Field(ge=0)
    completion_end: int = Field(ge=0)
    cached_tokens: int = Field(default=0, ge=0)
    cache_salt: str | None = None
    finish_reason: str = "stop"
    kv_versions: tuple[int, ...] = ()
    queue_s: float = 0.0
    first_token_s: float = 0.0
    total_s: float = 0.0
    reward: float | None = None
    replica: str | None = None
    admission_wait_s: float = 0.0
    sampling: TurnSampling | None = None
    """None in traces written before schema 3 (then μ is the raw logprob: temperature 1 is assumed)."""

    @model_validator(mode="after")
    def _ordered(self) -> Turn:
        if self.completion_end < self.prompt_end:
            raise ValueError("completion_end must not precede prompt_end")
        if self.prompt_end < self.prompt_start:
            raise ValueError("prompt_end must not precede prompt_start")
        if self.cached_tokens > self.prompt_end - self.prompt_start:
            raise ValueError("cached_tokens cannot exceed the prompt length")
        return self

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_end - self.prompt_start

    @property
    def completion_tokens(self) -> int:
        return self.completion_end - self.prompt_end


RolloutStatus = Literal["ok", "truncated", "error", "interrupted"]
TRAINED_STATUSES: tuple[RolloutStatus, ...] = ("ok", "truncated")
"""The statuses of rollouts that ended with a reward a trainer may learn from (``verbatim train``, the exports):
an error or an interrupted rollout is data, recorded, never trained."""
FAILED_STATUSES: tuple[RolloutStatus, ...] = ("error", "interrupted")
"""The statuses of failed rollouts: their reward is null (whatever the env summed or the agent returned before it
failed), so no mean counts them; summaries say how many they left out."""


class Rollout(Frozen):
    """A finished (or failed) rollout: ids, task, token columns, turns, outcome."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    schema_version: int = SCHEMA_VERSION
    run_id: str
    group_id: str
    rollout_id: str
    task: dict[str, Any] = Field(default_factory=dict)
    tokens: TokenColumns = Field(default_factory=TokenColumns.empty)
    turns: tuple[Turn, ...] = ()
    reward: float | None = None
    status: RolloutStatus = "ok"
    error: str | None = None
    info: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _failed_has_no_reward(cls, data: Any) -> Any:
        """The one rule for a failed rollout's reward (:data:`FAILED_STATUSES`): null, also when read from a
        trace written before the rule (which held the env's sum so far, or 0.0)."""
        if isinstance(data, dict) and data.get("status") in FAILED_STATUSES and data.get("reward") is not None:
            return {**data, "reward": None}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Rollout:
        n = len(self.tokens)
        for turn in self.turns:
            if turn.completion_end > n:
                raise ValueError(f"turn {turn.index} ends at {turn.completion_end} beyond {n} tokens")
        for before, after in zip(self.turns, self.turns[1:]):
            if after.prompt_start != before.prompt_start and after.prompt_start < before.completion_end:
                raise ValueError(f"turn {after.index} starts a segment at {after.prompt_start}, inside turn "
                                 f"{before.index} (which ends at {before.completion_end})")
        if self.status in ("error", "truncated", "interrupted") and not self.error:
            raise ValueError(f"a rollout with status {self.status!r} needs a reason in 'error'")
        if self.reward is not None and math.isnan(self.reward):
            raise ValueError("reward must not be NaN")
        return self

    def sampling(self) -> TurnSampling | None:
        """The sampling settings of its turns, when they all share one (a verbatim rollout's do); before
        schema 3 (turns record none), raw logprobs at temperature 1; None for settings that differ."""
        found = {turn.sampling or UNRECORDED_SAMPLING for turn in self.turns}
        return found.pop() if len(found) == 1 else None if found else UNRECORDED_SAMPLING

    def segments(self) -> tuple[Rollout, ...]:
        """The rollout as the token sequences it holds: itself, or one rollout per segment when its agent
        rewrote its history (each with its own tokens, turns counted from its start, the messages of that
        segment in ``info["messages"]`` and its number in ``info["segment"]``). A trainer trains each as
        its own sequence; the cache and extension rules hold within each."""
        starts = sorted({0, *(turn.prompt_start for turn in self.turns)})
        if len(starts) == 1:
            return (self,)
        ends = [*starts[1:], len(self.tokens)]
        breaks = list(self.info.get("segments") or ())
        pieces = []
        for k, (start, end) in enumerate(zip(starts, ends)):
            turns = tuple(t.model_copy(update={"prompt_start": 0, "prompt_end": t.prompt_end - start,
                                               "completion_end": t.completion_end - start})
                          for t in self.turns if start <= t.prompt_start < end)
            tokens = self.tokens.slice(start, end)
            messages = self.info.get("messages") if k == 0 else (breaks[k - 1].get("messages")
                                                                 if k - 1 < len(breaks) else None)
            info = {**self.info, "segment": k, "messages": messages or []}
            pieces.append(self.model_copy(update={"tokens": tokens, "turns": turns, "info": info}))
        return tuple(pieces)

    @property
    def row_id(self) -> str:
        """The id of this sequence as a trainer's row: the rollout's, with ``#k`` for segment k ≥ 1 of
        :meth:`segments`."""
        segment = self.info.get("segment") or 0
        return self.rollout_id if not segment else f"{self.rollout_id}#{segment}"

    def same_as(self, other: Rollout) -> bool:
        """Equality that compares token columns exactly (NaN == NaN)."""
        mine = self.model_dump(exclude={"tokens"})
        theirs = other.model_dump(exclude={"tokens"})
        return mine == theirs and self.tokens.equals(other.tokens)
