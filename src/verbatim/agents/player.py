"""Playing an agent's rollout: its function called with the task and a client of the rollout's endpoint.

The rollout is what the endpoint recorded (:class:`~verbatim.agents.session.AgentSession`): the opening
prompt, each completion as sampled and the bridged messages between them. Its reward is what the function
returned. An agent that raises, runs past ``--agent-timeout`` or returns something that is not a result is
a rollout with status ``error`` and that reason; so is one whose engine failure ended it, and one that never
called the model. A failed rollout's reward is null (``Rollout``'s rule; what the agent returned is kept in
``info["agent"]["returned_reward"]``). A history break is no error: the rollout goes on in a new segment
(``info["segments"]``). A request refused for the context or ``--max-turns`` makes the rollout ``truncated``,
with the reward the agent still returned (none if it raised on the refusal).
"""

from __future__ import annotations

import asyncio
import traceback
from functools import partial
from typing import Any

from verbatim.agents.command import CommandAgent
from verbatim.agents.endpoint import Endpoint
from verbatim.agents.loader import AgentCall
from verbatim.agents.messages import as_message
from verbatim.agents.result import AgentResult, read_result
from verbatim.agents.session import AgentSession
from verbatim.datamodel import Rollout
from verbatim.harness.env_output import describe_failure, jsonable
from verbatim.harness.rollout import Ended, LoopConfig, RolloutPlayer, RolloutSpec, in_thread

DEFAULT_AGENT_TIMEOUT_S = 600.0


def agent_players(model_name: str, timeout_s: float = DEFAULT_AGENT_TIMEOUT_S) -> Any:
    """What :class:`~verbatim.harness.run.Run` takes as ``make_player`` for an agent."""
    return partial(AgentPlayer, model_name=model_name, timeout_s=timeout_s)


class AgentPlayer(RolloutPlayer):
    """Plays agent rollouts through one endpoint, open while the player is entered."""

    def __init__(self, engine: Any, renderer: Any, config: LoopConfig, on_first_request: Any = None, *,
                 model_name: str = "verbatim", timeout_s: float = DEFAULT_AGENT_TIMEOUT_S) -> None:
        super().__init__(engine, renderer, config, on_first_request)
        self.endpoint = Endpoint(model_name)
        self.timeout_s = timeout_s

    async def __aenter__(self) -> AgentPlayer:
        await self.endpoint.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.endpoint.close()

    async def play(self, spec: RolloutSpec, env: AgentCall | CommandAgent) -> Rollout:
        session = AgentSession(spec, self)
        self.endpoint.sessions[spec.rollout_id] = session
        result: AgentResult | None = None
        trace = None
        try:
            result = read_result(await self._call(env, spec))
        except Ended as ended:
            error = ended.reason
            trace = traceback_text(ended.__cause__)
        except ValueError as exc:
            error = str(exc)
        else:
            error = None
        finally:
            self.endpoint.sessions.pop(spec.rollout_id, None)
            await self._end_session(spec.rollout_id)
        return self._rollout(spec, session, result, error, trace)

    async def _call(self, agent: AgentCall | CommandAgent, spec: RolloutSpec) -> Any:
        import openai

        url, key, task = self.endpoint.url(spec.rollout_id), self.endpoint.key, jsonable(spec.task)
        if isinstance(agent, CommandAgent):
            return await agent.run(task, url, key, self.timeout_s)
        if not agent.is_async:
            def call() -> Any:
                with openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=self.timeout_s) as client:
                    return agent.function(task, client)
            return await in_thread(call, self.timeout_s, "the agent")
        client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=self.timeout_s)
        try:
            return await asyncio.wait_for(agent.function(task, client), self.timeout_s)
        except asyncio.TimeoutError:
            raise Ended("error", f"the agent timed out after {self.timeout_s:g}s") from None
        except Exception as exc:  # noqa: BLE001 - the agent's own failure is the rollout's error
            raise Ended("error", f"the agent {describe_failure(exc)}") from exc
        finally:
            await client.close()

    def _rollout(self, spec: RolloutSpec, session: AgentSession, result: AgentResult | None,
                 error: str | None, trace: str | None = None) -> Rollout:
        status, reason, reward = "ok", None, result.reward if result else None
        if session.failure is not None:  # what broke it on our side says more than the agent's exception
            status, reason = "error", session.failure
        elif session.truncated is not None:  # a refusal the agent may have raised on: still a cut episode
            status, reason = "truncated", session.truncated + (f"; then {error}" if error else "")
        elif error is not None:
            status, reason = "error", error
        elif not session.ledger.turns:
            status, reason = "error", "the agent returned without asking the model for a completion"
        if result is not None and session.ledger.turns:
            session.ledger.set_turn_reward(result.reward)
        conversations = [*session.conversations, session.recorded]
        env_info: dict[str, Any] = dict(result.metrics) if result else {}
        if result is not None and result.solved is not None:
            env_info["solved"] = result.solved
        info = {"session_id": spec.rollout_id, "seed": spec.seed, "start_version": session.start_version,
                "stop_reason": reason or "done", "env": env_info,
                "messages": [_message(m) for m in conversations[0]], "tools": session.first_tools,
                "agent": {"requests": session.requests, "ignored_fields": dict(sorted(session.ignored.items()))}}
        if result is not None and status == "error":  # what it returned; the rollout's reward is null (failed)
            info["agent"]["returned_reward"] = result.reward
        if trace is not None:  # the one-line error's whole story
            info["agent"]["traceback"] = trace
        if spec.step is not None:
            info["step"] = spec.step
        if session.routes:
            info["routes"] = session.routes
        if session.breaks:  # each later segment: where the agent broke its history, and its own conversation
            info["segments"] = [{**brk, "messages": [_message(m) for m in conversation]}
                                for brk, conversation in zip(session.breaks, conversations[1:])]
        return session.ledger.to_rollout(run_id=spec.run_id, group_id=spec.group_id, rollout_id=spec.rollout_id,
                                         task=jsonable(spec.task), reward=reward,
                                         status=status, error=reason, info=jsonable(info))


TRACEBACK_CHARS = 8000
"""The end of an agent's traceback a rollout keeps (the frames nearest the raise)."""


def traceback_text(exc: BaseException | None) -> str | None:
    """The traceback of the agent's exception, as Python prints it (its last TRACEBACK_CHARS characters)."""
    if exc is None:
        return None
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text[-TRACEBACK_CHARS:]


def _message(message: dict[str, Any]) -> dict[str, Any]:
    return as_message(message).model_dump(mode="json", exclude_defaults=True)
