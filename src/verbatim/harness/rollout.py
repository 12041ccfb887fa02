"""One rollout: the append-only turn loop between an engine, a renderer and an env.

Each turn: generate from the ledger's tokens → append the completion exactly
as sampled → parse it → env.step → bridge the observation and the next
generation prompt → append. History is never re-rendered. A failure anywhere
(engine, env, renderer) ends the rollout with status ``error`` and the reason;
it never escapes as an exception.

Env calls run in daemon worker threads (:mod:`.workers`) under ``step_timeout_s``:
an env that hangs ends its rollout as ``error`` and keeps its worker, so it neither
holds one other rollouts need nor keeps the process from exiting. What an
env returns is checked (:mod:`.env_output`) before it is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from pydantic import Field

from verbatim.datamodel import Frozen, Rollout
from verbatim.engine.protocol import CachePolicy, Engine, Sampling, cache_salt, when_prefilled
from verbatim.engine.runtime import DEFAULT_MAX_MODEL_LEN
from verbatim.envs.base import Env
from verbatim.errors import VerbatimError
from verbatim.harness.env_output import checked_reset, checked_step, describe_failure, jsonable
from verbatim.harness.ledger import Ledger
from verbatim.harness.workers import WORKERS

MAX_CHARS_PER_TOKEN = 256
"""No tokenizer verbatim renders for packs more characters into one token; text longer than
``tokens left × this`` cannot fit and is not tokenized at all."""


INLINE_CHARS = 4096
"""New text up to this long is rendered on the event loop (a millisecond or two of tokenizing): the hop to a
worker thread and back, on cores the engine keeps busy, costs more than that."""


class LoopConfig(Frozen):
    """How every rollout of a run is played."""

    max_turns: int = Field(default=4, ge=1)
    sampling: Sampling = Field(default_factory=Sampling)
    context_budget: int = Field(default=DEFAULT_MAX_MODEL_LEN, ge=16)
    """Tokens a request may hold (prompt + max_tokens): the engine's context length."""
    cache_policy: CachePolicy = CachePolicy.KEEP
    step_timeout_s: float = Field(default=60.0, gt=0)


class RolloutSpec(Frozen):
    run_id: str
    group_id: str
    rollout_id: str
    task: dict[str, Any]
    seed: int
    step: int | None = None
    """The training step it belongs to (recorded in ``info["step"]``), None outside training."""


REQUEST_SEEDS = 2**31
"""Request seeds lie in 0 .. this - 1: within every engine's range (vLLM seeds a torch generator per request;
an OpenAI-style server takes a 32-bit ``seed``)."""


def request_seed(rollout_seed: int, rollout_id: str, call: int) -> int:
    """The sampling seed of a rollout's ``call``-th engine request: a pure function of the rollout's seed
    (itself of the run's ``--seed``, step, group and index) and id, so a request draws the same tokens
    whichever batch it lands in and whatever ran before it."""
    digest = hashlib.blake2b(f"{rollout_seed}/{rollout_id}/{call}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % REQUEST_SEEDS


CONTEXT_BUDGET = "context budget"
"""How the reason of a rollout that ran out of context begins (a step that cannot train names it)."""
MAX_TURNS = "max turns"
"""How the reason of a rollout cut by --max-turns begins (the summary counts them, a step that cannot train
names them)."""


class Ended(Exception):
    """The episode ended with a status and a reason (an env's rollout here, an agent's in ``agents/``)."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


async def in_thread(call: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``call()`` in a daemon worker; a timeout abandons the worker, an exception becomes the reason."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def work() -> None:
        try:
            outcome = (call(), None)
        except Exception as exc:  # noqa: BLE001 - handed to the loop as the rollout's reason
            outcome = (None, exc)
        except BaseException as exc:  # noqa: BLE001 - sys.exit() in an env must not stop the run
            outcome = (None, Ended("error", f"{what} raised {type(exc).__name__}: {exc}"))
        try:
            loop.call_soon_threadsafe(_settle, future, *outcome)
        except RuntimeError:  # the loop closed while this env was hanging: nobody waits any more
            pass

    WORKERS.submit(work)
    try:
        return await asyncio.wait_for(future, timeout_s)
    except asyncio.TimeoutError:
        raise Ended("error", f"{what} timed out after {timeout_s:g}s") from None
    except Ended:
        raise
    except Exception as exc:  # an env's own bug is data, not a crash
        raise ended_by(exc, what) from exc


def ended_by(exc: Exception, what: str) -> Ended:
    """The rollout's end when ``what`` raised ``exc``."""
    if isinstance(exc, VerbatimError):
        return Ended("error", f"{what}: {exc.one_line()}")
    return Ended("error", f"{what} {describe_failure(exc)}")


def _settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():  # timed out or cancelled already
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class RolloutPlayer:
    """Plays rollouts of one run; holds what every rollout shares."""

    def __init__(self, engine: Engine, renderer: Any, config: LoopConfig,
                 on_first_request: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.renderer = renderer
        self.config = config
        stops = tuple(sorted(set(config.sampling.stop_token_ids) | set(renderer.stop_token_ids)))
        self.sampling = config.sampling.model_copy(update={"stop_token_ids": stops})
        self.recorded_sampling = self.sampling.record()
        """What every turn records of the settings: the distribution its μ describes."""
        self.on_first_request = on_first_request
        self._tokenizing = threading.Lock()  # renderers run off the event loop, one call at a time

    def sampling_for(self, spec: RolloutSpec, call: int) -> Sampling:
        """The run's sampling settings with the seed of ``spec``'s ``call``-th request."""
        return self.sampling.model_copy(update={"seed": request_seed(spec.seed, spec.rollout_id, call)})

    async def __aenter__(self) -> RolloutPlayer:
        return self

    @contextlib.contextmanager
    def first_request(self, group_id: str, first: bool = True) -> Iterator[None]:
        """Around a rollout's first request: it releases the group's followers (``on_first_request``) at its
        first token where the engine streams (the shared prompt is in the prefix cache then), else once
        answered. Other requests pass through."""
        if not first or self.on_first_request is None:
            yield
            return
        release = partial(self.on_first_request, group_id)
        with when_prefilled(release):
            yield
        release()

    async def __aexit__(self, *exc: object) -> None:
        """Nothing to release (an agent's player closes its endpoint here)."""

    async def play(self, spec: RolloutSpec, env: Env) -> Rollout:
        ledger = Ledger()
        state: dict[str, Any] = {"messages": [], "reward": 0.0, "env_info": {}, "stop": "done"}
        start_version = self.engine.version
        status, reason = "ok", None
        try:
            await self._turns(spec, env, ledger, state, start_version)
        except Ended as ended:
            status, reason = ended.status, ended.reason
        except VerbatimError as exc:
            status, reason = "error", exc.one_line()
        except Exception as exc:  # noqa: BLE001 - a failed rollout is data
            status, reason = "error", " ".join(f"{type(exc).__name__}: {exc}".split())
        finally:
            await self._end_session(spec.rollout_id)
        info = {"session_id": spec.rollout_id, "seed": spec.seed, "start_version": start_version,
                "stop_reason": state["stop"] if status == "ok" else reason, "env": jsonable(state["env_info"]),
                "messages": [m.model_dump(mode="json", exclude_defaults=True) for m in state["messages"]],
                "tools": state.get("tools")}
        if spec.step is not None:
            info["step"] = spec.step
        if state.get("routes"):  # the router's decision per turn: reason, migration, expected cache loss
            info["routes"] = state["routes"]
        return ledger.to_rollout(run_id=spec.run_id, group_id=spec.group_id, rollout_id=spec.rollout_id,
                                 task=jsonable(spec.task), reward=state["reward"], status=status, error=reason,
                                 info=jsonable(info))

    async def _turns(self, spec: RolloutSpec, env: Env, ledger: Ledger, state: dict, start_version: int) -> None:
        timeout = self.config.step_timeout_s
        reset = checked_reset(await in_thread(lambda: env.reset(spec.task, spec.seed), timeout, "env.reset"))
        tools = list(reset.tools) if reset.tools else None
        state["tools"] = tools
        state["messages"].extend(reset.messages)
        chars = self._check_text(reset.messages, 0, "the opening prompt")
        prompt = await self.render_text(lambda: self.renderer.render(list(reset.messages), tools=tools,
                                                                 add_generation_prompt=True), chars, "render")
        self._check_budget(len(prompt.token_ids), "the opening prompt")
        ledger.append_prompt(prompt.token_ids)
        for turn in range(self.config.max_turns):
            salt = cache_salt(self.config.cache_policy, self.engine.version, start_version)
            with self.first_request(spec.group_id, turn == 0):
                completion = await self.engine.generate(ledger.view(), self.sampling_for(spec, turn),
                                                        session_id=spec.rollout_id, group_id=spec.group_id,
                                                        cache_salt=salt)
            ledger.append_completion(completion, sampling=self.recorded_sampling)
            if "route" in completion.extra:
                state.setdefault("routes", []).append(completion.extra["route"])
            message = self.renderer.parse_completion(completion.token_ids.tolist())
            state["messages"].append(message)
            result = checked_step(await in_thread(lambda m=message: env.step(m), timeout, "env.step"))
            ledger.set_turn_reward(result.reward)
            state["reward"] += float(result.reward)
            state["env_info"] = result.info
            if result.done:
                return
            if turn == self.config.max_turns - 1:
                raise Ended("truncated", f"{MAX_TURNS} ({self.config.max_turns}) reached before the env was done")
            what = f"the prompt of turn {turn + 1}"
            chars = self._check_text(result.messages, len(ledger), what)
            bridge = await self.render_text(lambda r=result: self.renderer.bridge(ledger.view(), list(r.messages),
                                                                              tools=tools), chars, "bridge")
            self._check_budget(len(ledger) + len(bridge), what)
            state["messages"].extend(result.messages)
            ledger.append_observation(bridge)

    async def render_text(self, call: Callable[[], Any], chars: int, what: str) -> Any:
        """A renderer call on ``chars`` of new text: on the event loop where the text is short and the
        tokenizer free, else in a worker thread, so a long text does not stall the other rollouts."""
        if chars <= INLINE_CHARS and self._tokenizing.acquire(blocking=False):
            try:
                return call()
            except Exception as exc:  # noqa: BLE001 - a renderer's failure ends the rollout, as off the loop
                raise ended_by(exc, what) from exc
            finally:
                self._tokenizing.release()

        def locked() -> Any:
            with self._tokenizing:
                return call()
        return await in_thread(locked, self.config.step_timeout_s, what)

    async def _end_session(self, session_id: str) -> None:
        """Tell a router the session is over, so admission stops counting its context."""
        end = getattr(self.engine, "end_session", None)
        if end is not None:
            try:
                await end(session_id)
            except Exception:  # noqa: BLE001 - bookkeeping must not turn a finished rollout into a failure
                pass

    def _check_text(self, messages: Any, used: int, what: str) -> int:
        """The characters of ``messages``; ends the rollout before tokenizing text that cannot fit whatever
        the tokenizer (an enormous observation)."""
        chars = sum(len(m.content) + len(m.reasoning or "") for m in messages)
        reason = self.text_overrun(chars, used, what)
        if reason is not None:
            raise Ended("truncated", reason)
        return chars

    def _check_budget(self, prompt_tokens: int, what: str) -> None:
        reason = self.budget_overrun(prompt_tokens, what)
        if reason is not None:
            raise Ended("truncated", reason)

    def text_overrun(self, chars: int, used: int, what: str) -> str | None:
        """Why ``chars`` of new text cannot fit after ``used`` tokens (None when they may): the one rule of a
        rollout's context, for an env's observations and an agent's messages alike."""
        room = max(self.config.context_budget - self.sampling.max_tokens - used, 0)
        if chars <= room * MAX_CHARS_PER_TOKEN:
            return None
        return (f"{CONTEXT_BUDGET}: {what} adds {chars} characters, more than the {room} tokens left in the "
                f"{self.config.context_budget}-token context can hold")

    def budget_overrun(self, prompt_tokens: int, what: str) -> str | None:
        """Why a request of ``prompt_tokens`` cannot be sampled with ``max_tokens`` (None when it can)."""
        if prompt_tokens + self.sampling.max_tokens <= self.config.context_budget:
            return None
        return (f"{CONTEXT_BUDGET}: {what} needs {prompt_tokens} + {self.sampling.max_tokens} tokens, over the "
                f"{self.config.context_budget}-token context")
