"""One rollout's conversation behind the agent endpoint: each chat request extends the ledger, or is refused.

The first request's messages (and tools) are rendered once into the opening prompt. Every later request must
repeat the conversation as recorded — the earlier messages as the agent sent them, verbatim's replies as it
returned them — and add new user or tool messages at the end: those alone are appended, through
``Renderer.bridge``, and the completion's sampled tokens follow as sampled. Nothing is re-rendered.

A request that does not extend the conversation (an agent that dropped, edited, summarised or reordered
earlier messages, changed its tools, appended a system or assistant message, or resent a request) is a
history break, never hidden: the request is answered from a new **segment**, a prompt rendered from its
messages and appended after everything recorded (:meth:`~verbatim.harness.ledger.Ledger.start_segment`),
and the break is recorded — the message index, its role and the first differing field, the turn and token
where the segment starts — for ``lint trace``, the summary, the viewer and the trainer, which trains each
segment as its own sequence. A request while another of the same rollout is in flight is 409; one whose
prompt and ``--max-tokens`` exceed the context is 400 naming the limit, and so is one past ``--max-turns``
requests; neither appends anything.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from verbatim.agents import messages as chat
from verbatim.agents.messages import BadRequest
from verbatim.datamodel import Completion
from verbatim.engine.protocol import cache_salt
from verbatim.errors import VerbatimError
from verbatim.harness.ledger import Ledger
from verbatim.harness.rollout import CONTEXT_BUDGET, MAX_TURNS, RolloutSpec

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "logit_bias", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed", "max_tokens", "max_completion_tokens",
                   "stop", "response_format", "logprobs", "top_logprobs")
"""Request fields that would change what is sampled or returned: the run's settings govern every request, so
these are ignored and counted (μ must describe the run's policy)."""


class Refusal(Exception):
    """A request the endpoint answers with an HTTP error and an OpenAI-style error object."""

    def __init__(self, status: int, message: str, kind: str, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param


@dataclass
class ChatRequest:
    """What the endpoint reads of a chat completions body."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    ignored: list[str] = field(default_factory=list)


def read_request(body: Any) -> ChatRequest:
    """The request in ``body``; :class:`BadRequest` names a malformed field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadRequest("tools must be a list of objects", "tools")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise BadRequest("n must be 1: each request of a rollout continues its one conversation", "n")
    choice = body.get("tool_choice")
    ignored = [name for name in SAMPLING_FIELDS if body.get(name) is not None]
    if choice not in (None, "auto"):
        ignored.append("tool_choice")  # the run's policy samples; no mask forces or forbids a call
    options = body.get("stream_options")
    return ChatRequest(messages=chat.canonical_all(body.get("messages")), tools=tools,
                       stream=bool(body.get("stream")), model=body.get("model"), ignored=ignored,
                       include_usage=isinstance(options, dict) and bool(options.get("include_usage")))


@dataclass(frozen=True)
class Addition:
    """What a request adds to the ledger, decided before anything is appended."""

    source: str
    """``prompt`` (the first request), ``segment`` (a new one after a history break) or ``env`` (bridged)."""
    ids: list[int]
    messages: list[dict[str, Any]]
    """The messages those tokens hold: all of the request's for a prompt, the new ones for ``env``."""
    tools: list[dict[str, Any]] | None = None
    broken: dict[str, Any] | None = None


class AgentSession:
    """The conversation, ledger and outcome of one agent rollout (``player`` holds what rollouts share)."""

    def __init__(self, spec: RolloutSpec, player: Any) -> None:
        self.spec, self.player = spec, player
        self.ledger = Ledger()
        self.recorded: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] | None = None
        """The current segment's tools (``first_tools``: the first segment's)."""
        self.first_tools: list[dict[str, Any]] | None = None
        self.ignored: Counter[str] = Counter()
        self.start_version = player.engine.version
        self.requests = 0
        self.failure: str | None = None
        """Why the endpoint could not go on (the engine, or a bug of ours): the rollout's error."""
        self.truncated: str | None = None
        """A request refused for the context or --max-turns: the rollout is ``truncated``."""
        self.routes: list[Any] = []
        self.breaks: list[dict[str, Any]] = []
        """Each history break: where the agent's request stopped extending the conversation, the turn and token
        where the new segment starts (``info["segments"]``)."""
        self.conversations: list[list[dict[str, Any]]] = []
        """The conversations of the segments before the current one (``recorded``)."""
        self._lock = asyncio.Lock()

    async def complete(self, request: ChatRequest) -> dict[str, Any]:
        """Answer one request: ``{"message", "finish_reason", "usage", "index"}`` (canonical message)."""
        if self._lock.locked():
            raise Refusal(409, f"rollout {self.spec.rollout_id} already has a request in flight; "
                               "send its requests one at a time", "invalid_request_error", "request_in_flight")
        async with self._lock:
            self.requests += 1
            self.ignored.update(request.ignored)
            if self.failure is not None:
                raise Refusal(400, f"this rollout cannot go on: {self.failure}", "invalid_request_error",
                              "rollout_failed")
            if len(self.ledger.turns) >= self.player.config.max_turns:
                self._truncate(f"{MAX_TURNS} ({self.player.config.max_turns}) reached: the agent asked for more")
            new = await self._prompt(request)
            return await self._generate(new)

    # -- the prompt ---------------------------------------------------------------

    async def _prompt(self, request: ChatRequest) -> Addition:
        """What this request adds (not yet appended): a prompt rendered from all its messages (the first request,
        or a new segment after a history break), or the tokens bridging its new messages."""
        broken = self._where_broken(request) if self.recorded else None
        if not self.recorded or broken is not None:
            chars = self._check_text(request.messages, 0, "the opening prompt" if broken is None else "the new segment")
            rendered = await self.player.render_text(lambda: self.player.renderer.render(
                [chat.as_message(m) for m in request.messages], tools=request.tools,
                add_generation_prompt=True), chars, "render")
            return Addition("prompt" if broken is None else "segment", list(rendered.token_ids), request.messages,
                            request.tools, broken)
        added = request.messages[len(self.recorded):]
        chars = self._check_text(added, len(self.ledger.view()), "this request's new text")
        ids = await self.player.render_text(lambda: self.player.renderer.bridge(
            self.ledger.view(), [chat.as_message(m) for m in added], tools=self.tools), chars, "bridge")
        return Addition("env", list(ids), added, self.tools)

    def _where_broken(self, request: ChatRequest) -> dict[str, Any] | None:
        """Why ``request`` does not extend the conversation (None when it does): the break a new segment records."""
        broken = chat.first_difference(self.recorded, request.messages)
        if broken is None and request.tools != self.tools:
            broken = chat.where_broken(None, None, "tools", "the tools differ from the segment's first request's")
        added = request.messages[len(self.recorded):]
        if broken is None and not added:
            broken = chat.where_broken(None, None, "nothing_new",
                                       f"no new message after the {len(self.recorded)} recorded (a request resent)")
        roles = getattr(self.player.renderer, "bridge_roles", ("user", "tool"))
        for offset, message in enumerate(added):
            if broken is None and message["role"] not in roles:
                index = len(self.recorded) + offset
                broken = chat.where_broken(index, message["role"], "appended",
                                           f"message {index} ({message['role']}) was appended; only "
                                           f"{' and '.join(roles)} messages can follow a reply")
        return broken

    def _check_text(self, messages: list[dict[str, Any]], used: int, what: str) -> int:
        chars = sum(len(m["content"]) + len(m.get("reasoning") or "") for m in messages)
        reason = self.player.text_overrun(chars, used, what)
        if reason is not None:
            self._truncate(reason)
        return chars

    def _truncate(self, reason: str) -> None:
        self.truncated = reason
        raise Refusal(400, reason, "invalid_request_error", "context_length_exceeded"
                      if reason.startswith(CONTEXT_BUDGET) else "max_turns_reached")

    # -- the completion -------------------------------------------------------------

    async def _generate(self, new: Addition) -> dict[str, Any]:
        prompt = len(new.ids) + (len(self.ledger.view()) if new.source == "env" else 0)
        reason = self.player.budget_overrun(prompt, "this request")
        if reason is not None:
            self._truncate(f"{reason} (--max-model-len)")
        if new.source == "prompt":
            self.ledger.append_prompt(new.ids)
        elif new.source == "segment":
            self._begin_segment(new)
        else:
            self.ledger.append_observation(new.ids)
        if new.source == "prompt":
            self.first_tools = new.tools
        self.tools = new.tools
        self.recorded.extend(new.messages)
        completion = await self._sample()
        turn = self.ledger.append_completion(completion, sampling=self.player.recorded_sampling)
        message = self.player.renderer.parse_completion(completion.token_ids.tolist())
        call_ids = [call.id or f"call_{turn.index}_{k}" for k, call in enumerate(message.tool_calls)]
        answer = chat.reply(message, call_ids)
        self.recorded.append(answer)
        finish = completion.finish_reason
        if finish == "stop" and message.tool_calls:
            finish = "tool_calls"
        usage = {"prompt_tokens": completion.prompt_tokens, "completion_tokens": len(completion.token_ids),
                 "total_tokens": completion.prompt_tokens + len(completion.token_ids),
                 "prompt_tokens_details": {"cached_tokens": completion.cached_tokens}}
        return {"message": answer, "finish_reason": finish, "usage": usage, "index": turn.index}

    def _begin_segment(self, new: Addition) -> None:
        """The request rewrote the history: what was recorded stays, and a new segment starts from its messages."""
        start = self.ledger.start_segment(new.ids)
        self.breaks.append({**(new.broken or {}), "turn": len(self.ledger.turns), "start": start,
                            "tools_changed": new.tools != self.tools})
        self.conversations.append(self.recorded)
        self.recorded = []

    async def _sample(self) -> Completion:
        player, spec = self.player, self.spec
        salt = cache_salt(player.config.cache_policy, player.engine.version, self.start_version)
        try:
            with player.first_request(spec.group_id, not self.ledger.turns):
                completion = await player.engine.generate(self.ledger.view(),
                                                          player.sampling_for(spec, len(self.ledger.turns)),
                                                          session_id=spec.rollout_id, group_id=spec.group_id,
                                                          cache_salt=salt)
        except VerbatimError as exc:
            self.failure = exc.one_line()
            raise Refusal(503, f"the engine failed: {self.failure}", "server_error", "engine_failed") from exc
        if "route" in completion.extra:
            self.routes.append(completion.extra["route"])
        return completion
