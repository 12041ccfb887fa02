"""One rollout's conversation behind the agent endpoint: each chat request extends the ledger, or is refused.

The first request's messages (and tools) are rendered once into the opening prompt. Every later request must
repeat the conversation as recorded — the earlier messages as the agent sent them, verbatim's replies as it
returned them — and add new user or tool messages at the end: those alone are appended, through
``Renderer.bridge``, and the completion's sampled tokens follow as sampled. Nothing is re-rendered.

A request that does not extend the conversation (an agent that dropped, edited or reordered earlier
messages, changed its tools or appended a system or assistant message) is a history break: the endpoint
answers 400 (``history_rewritten``) naming the message, the role and the first differing field, and the
rollout records the break as its error. A request while another of the same rollout is in flight is 409; one
whose prompt and ``--max-tokens`` exceed the context is 400 naming the limit, and so is one past
``--max-turns`` requests; neither appends anything.
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
from verbatim.harness.rollout import CONTEXT_BUDGET, MAX_CHARS_PER_TOKEN, RolloutSpec

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


class AgentSession:
    """The conversation, ledger and outcome of one agent rollout (``player`` holds what rollouts share)."""

    def __init__(self, spec: RolloutSpec, player: Any) -> None:
        self.spec, self.player = spec, player
        self.ledger = Ledger()
        self.recorded: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] | None = None
        self.ignored: Counter[str] = Counter()
        self.start_version = player.engine.version
        self.requests = 0
        self.failure: str | None = None
        """Why the endpoint could not go on (a history break, the engine): the rollout's error."""
        self.truncated: str | None = None
        """A request refused for the context or --max-turns: the rollout is ``truncated``."""
        self.routes: list[Any] = []
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
                self._truncate(f"max turns ({self.player.config.max_turns}) reached: the agent asked for more")
            new = await self._prompt(request)
            return await self._generate(new)

    # -- the prompt ---------------------------------------------------------------

    async def _prompt(self, request: ChatRequest) -> tuple[str, list[int], list[dict[str, Any]]]:
        """What this request adds to the ledger (not yet appended): ``prompt`` or ``env`` tokens, and the
        messages they hold."""
        if not self.recorded:
            self._check_text(request.messages, 0, "the opening prompt")
            rendered = await self.player._off_loop(lambda: self.player.renderer.render(
                [chat.as_message(m) for m in request.messages], tools=request.tools,
                add_generation_prompt=True), "render")
            self.tools = request.tools
            return "prompt", list(rendered.token_ids), request.messages
        self._check_extends(request)
        added = request.messages[len(self.recorded):]
        self._check_text(added, len(self.ledger), "the new messages")
        ids = await self.player._off_loop(lambda: self.player.renderer.bridge(
            self.ledger.view(), [chat.as_message(m) for m in added], tools=self.tools), "bridge")
        return "env", list(ids), added

    def _check_extends(self, request: ChatRequest) -> None:
        where = chat.first_difference(self.recorded, request.messages)
        if where is None and request.tools != self.tools:
            where = "the tools differ from the first request's"
        added = request.messages[len(self.recorded):]
        if where is None and not added:
            where = f"no new message after the {len(self.recorded)} recorded"
        roles = getattr(self.player.renderer, "bridge_roles", ("user", "tool"))
        for offset, message in enumerate(added):
            if where is None and message["role"] not in roles:
                where = (f"message {len(self.recorded) + offset} ({message['role']}) was appended; only "
                         f"{' and '.join(roles)} messages can follow a reply")
        if where is not None:
            self.failure = f"the agent rewrote its history: {where}"
            raise Refusal(400, f"{self.failure}; verbatim keeps a rollout's history token-exact and does not "
                               "re-render it", "invalid_request_error", "history_rewritten")

    def _check_text(self, messages: list[dict[str, Any]], used: int, what: str) -> None:
        chars = sum(len(m["content"]) + len(m.get("reasoning") or "") for m in messages)
        room = max(self.player.config.context_budget - self.player.sampling.max_tokens - used, 0)
        if chars > room * MAX_CHARS_PER_TOKEN:
            self._truncate(f"{CONTEXT_BUDGET}: {what} add {chars} characters, more than the {room} tokens left "
                           f"in the {self.player.config.context_budget}-token context can hold")

    def _truncate(self, reason: str) -> None:
        self.truncated = reason
        raise Refusal(400, reason, "invalid_request_error", "context_length_exceeded"
                      if reason.startswith(CONTEXT_BUDGET) else "max_turns_reached")

    # -- the completion -------------------------------------------------------------

    async def _generate(self, new: tuple[str, list[int], list[dict[str, Any]]]) -> dict[str, Any]:
        source, ids, added = new
        budget, max_tokens = self.player.config.context_budget, self.player.sampling.max_tokens
        if len(self.ledger) + len(ids) + max_tokens > budget:
            self._truncate(f"{CONTEXT_BUDGET}: this request needs {len(self.ledger) + len(ids)} + {max_tokens} "
                           f"tokens, over the {budget}-token context (--max-model-len)")
        if source == "prompt":
            self.ledger.append_prompt(ids)
        else:
            self.ledger.append_observation(ids)
        self.recorded.extend(added)
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

    async def _sample(self) -> Completion:
        player, spec = self.player, self.spec
        salt = cache_salt(player.config.cache_policy, player.engine.version, self.start_version)
        try:
            completion = await player.engine.generate(self.ledger.view(), player.sampling,
                                                      session_id=spec.rollout_id, group_id=spec.group_id,
                                                      cache_salt=salt)
        except VerbatimError as exc:
            self.failure = exc.one_line()
            raise Refusal(503, f"the engine failed: {self.failure}", "server_error", "engine_failed") from exc
        if not self.ledger.turns and player.on_first_request:
            player.on_first_request(spec.group_id)
        if "route" in completion.extra:
            self.routes.append(completion.extra["route"])
        return completion
