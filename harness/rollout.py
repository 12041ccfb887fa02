"""One rollout: the append-only turn loop between an engine, a renderer and an env.

Each turn: generate from the ledger's tokens → append the completion exactly
as sampled → parse it → env.step → bridge the observation and the next
generation prompt → append. History is never re-rendered. A failure anywhere
(engine, env, renderer) ends the rollout with status ``error`` and the reason;
it never escapes as an exception.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from pydantic import Field

from ..datamodel import Frozen, Rollout
from ..engine.protocol import CachePolicy, Engine, Sampling, cache_salt
from ..envs.base import Env, Reset, StepResult
from ..errors import VerbatimError
from .ledger import Ledger


class LoopConfig(Frozen):
    """How every rollout of a run is played."""

    max_turns: int = Field(default=4, ge=1)
    sampling: Sampling = Field(default_factory=Sampling)
    context_budget: int = Field(default=4096, ge=16)
    """Tokens a request may hold (prompt + max_tokens): the engine's context length."""
    cache_policy: CachePolicy = CachePolicy.KEEP
    step_timeout_s: float = Field(default=60.0, gt=0)


class RolloutSpec(Frozen):
    run_id: str
    group_id: str
    rollout_id: str
    task: dict[str, Any]
    seed: int


class _Ended(Exception):
    """Internal: the episode ended with a status and a reason."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


async def _in_thread(call: Callable[[], Any], timeout_s: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(asyncio.to_thread(call), timeout_s)
    except asyncio.TimeoutError:
        raise _Ended("error", f"{what} timed out after {timeout_s:g}s") from None
    except _Ended:
        raise
    except Exception as exc:  # an env's own bug is data, not a crash
        raise _Ended("error", f"{what} raised {type(exc).__name__}: {exc}") from exc


def _jsonable(value: Any) -> Any:
    """Env info must survive the trace's JSON columns; anything else becomes its repr."""
    return json.loads(json.dumps(value, default=repr))


class RolloutPlayer:
    """Plays rollouts of one run; holds what every rollout shares."""

    def __init__(self, engine: Engine, renderer: Any, config: LoopConfig,
                 on_first_request: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.renderer = renderer
        self.config = config
        stops = tuple(sorted(set(config.sampling.stop_token_ids) | set(renderer.stop_token_ids)))
        self.sampling = config.sampling.model_copy(update={"stop_token_ids": stops})
        self.on_first_request = on_first_request

    async def play(self, spec: RolloutSpec, env: Env) -> Rollout:
        ledger = Ledger()
        state: dict[str, Any] = {"messages": [], "reward": 0.0, "env_info": {}, "stop": "done"}
        start_version = self.engine.version
        status, reason = "ok", None
        try:
            await self._turns(spec, env, ledger, state, start_version)
        except _Ended as ended:
            status, reason = ended.status, ended.reason
        except VerbatimError as exc:
            status, reason = "error", exc.one_line()
        except Exception as exc:  # noqa: BLE001 - a failed rollout is data
            status, reason = "error", f"{type(exc).__name__}: {exc}"
        finally:
            await self._end_session(spec.rollout_id)
        info = {"session_id": spec.rollout_id, "seed": spec.seed, "start_version": start_version,
                "stop_reason": state["stop"] if status == "ok" else reason, "env": state["env_info"],
                "messages": [m.model_dump(mode="json", exclude_defaults=True) for m in state["messages"]],
                "tools": state.get("tools")}
        if state.get("routes"):  # the router's decision per turn: reason, migration, expected cache loss
            info["routes"] = state["routes"]
        info = _jsonable(info)
        return ledger.to_rollout(run_id=spec.run_id, group_id=spec.group_id, rollout_id=spec.rollout_id,
                                 task=spec.task, reward=state["reward"], status=status, error=reason, info=info)

    async def _turns(self, spec: RolloutSpec, env: Env, ledger: Ledger, state: dict, start_version: int) -> None:
        timeout = self.config.step_timeout_s
        reset: Reset = await _in_thread(lambda: env.reset(spec.task, spec.seed), timeout, "env.reset")
        tools = list(reset.tools) if reset.tools else None
        state["tools"] = tools
        state["messages"].extend(reset.messages)
        prompt = self.renderer.render(list(reset.messages), tools=tools, add_generation_prompt=True)
        self._check_budget(len(prompt.token_ids), "the opening prompt")
        ledger.append_prompt(prompt.token_ids)
        for turn in range(self.config.max_turns):
            salt = cache_salt(self.config.cache_policy, self.engine.version, start_version)
            completion = await self.engine.generate(ledger.view(), self.sampling, session_id=spec.rollout_id,
                                                    group_id=spec.group_id, cache_salt=salt)
            if turn == 0 and self.on_first_request:
                self.on_first_request(spec.group_id)
            ledger.append_completion(completion)
            if "route" in completion.extra:
                state.setdefault("routes", []).append(completion.extra["route"])
            message = self.renderer.parse_completion(completion.token_ids.tolist())
            state["messages"].append(message)
            result: StepResult = await _in_thread(lambda m=message: env.step(m), timeout, "env.step")
            ledger.set_turn_reward(result.reward)
            state["reward"] += float(result.reward)
            state["env_info"] = result.info
            if result.done:
                return
            if turn == self.config.max_turns - 1:
                raise _Ended("truncated", f"max turns ({self.config.max_turns}) reached before the env was done")
            bridge = self.renderer.bridge(ledger.view(), list(result.messages), tools=tools)
            self._check_budget(len(ledger) + len(bridge), f"the prompt of turn {turn + 1}")
            state["messages"].extend(result.messages)
            ledger.append_observation(bridge)

    async def _end_session(self, session_id: str) -> None:
        """Tell a router the session is over, so admission stops counting its context."""
        end = getattr(self.engine, "end_session", None)
        if end is not None:
            try:
                await end(session_id)
            except Exception:  # noqa: BLE001 - bookkeeping must not turn a finished rollout into a failure
                pass

    def _check_budget(self, prompt_tokens: int, what: str) -> None:
        need = prompt_tokens + self.sampling.max_tokens
        if need > self.config.context_budget:
            raise _Ended("truncated", f"context budget: {what} needs {prompt_tokens} + {self.sampling.max_tokens} "
                                      f"tokens, over the {self.config.context_budget}-token context")
