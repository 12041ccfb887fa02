"""The baseline for benchmarks: a harness that re-renders history from messages every turn.

It is what most agent harnesses do: keep chat messages, render the whole
conversation with the chat template before each request, send it, parse the
reply back into a message. It keeps no token history, fires a group's
rollouts all at once, and so pays for every token the template changes.
Used only to measure verbatim against it, through the same engine and sampling.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field

from verbatim.datamodel import Frozen, Message
from verbatim.envs.base import EnvFactory
from verbatim.errors import VerbatimError
from verbatim.harness.rollout import LoopConfig, RolloutSpec


class BaselineRequest(Frozen):
    prompt_ids: tuple[int, ...]
    cached_tokens: int
    generated_tokens: int
    logprobs: tuple[float, ...] = Field(default=())
    completion_ids: tuple[int, ...] = Field(default=())


class BaselineRollout(Frozen):
    """A re-rendering rollout: its requests, and the messages a trainer would re-render at the end."""

    rollout_id: str
    requests: tuple[BaselineRequest, ...]
    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] | None = None
    error: str | None = None
    """Why the rollout stopped early (a failed request, a render or env error); None when it played out."""


async def baseline_rollout(engine: Any, renderer: Any, factory: EnvFactory, spec: RolloutSpec,
                           loop: LoopConfig) -> BaselineRollout:
    """Play one rollout the re-rendering way; return what each request cost."""
    env = factory.make()
    reset = await asyncio.to_thread(env.reset, spec.task, spec.seed)
    messages, tools = list(reset.messages), (list(reset.tools) if reset.tools else None)
    sampling = loop.sampling.model_copy(update={"stop_token_ids": tuple(renderer.stop_token_ids)})
    requests: list[BaselineRequest] = []
    for _ in range(loop.max_turns):
        prompt = renderer.render(messages, tools=tools, add_generation_prompt=True).token_ids
        if len(prompt) + sampling.max_tokens > loop.context_budget:
            break
        completion = await engine.generate(prompt, sampling, session_id=spec.rollout_id, group_id=spec.group_id)
        requests.append(BaselineRequest(prompt_ids=tuple(prompt), cached_tokens=completion.cached_tokens,
                                        generated_tokens=len(completion.token_ids),
                                        logprobs=tuple(float(x) for x in completion.logprobs),
                                        completion_ids=tuple(int(t) for t in completion.token_ids)))
        message = renderer.parse_completion(completion.token_ids.tolist())
        messages.append(message)
        result = await asyncio.to_thread(env.step, message)
        if result.done:
            break
        messages.extend(result.messages)
    return BaselineRollout(rollout_id=spec.rollout_id, requests=tuple(requests), messages=tuple(messages),
                           tools=tuple(tools) if tools else None)


async def baseline_run(engine: Any, renderer: Any, factory: EnvFactory, groups: list[list[RolloutSpec]],
                       loop: LoopConfig, concurrency: int) -> list[BaselineRollout]:
    """Every rollout at once (bounded by ``concurrency``), as a message-level harness sends them. A rollout
    that fails is returned with its ``error`` (and no requests), as verbatim records one."""
    limit = asyncio.Semaphore(concurrency)

    async def one(spec: RolloutSpec) -> BaselineRollout:
        async with limit:
            try:
                return await baseline_rollout(engine, renderer, factory, spec, loop)
            except VerbatimError as exc:
                return BaselineRollout(rollout_id=spec.rollout_id, requests=(), messages=(), error=str(exc))

    return list(await asyncio.gather(*(one(s) for group in groups for s in group)))
