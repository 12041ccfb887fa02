"""The parts every run is composed of, from the names a user gives: what the rollouts play, who plays them,
the renderer, the engine. ``verbatim run`` and :mod:`verbatim.jobs.train` build their runs from these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from verbatim.datamodel import Frozen
from verbatim.engine.models import DEFAULT_MODEL
from verbatim.engine.router import Router
from verbatim.engine.runtime import DEFAULT_MAX_MODEL_LEN, MAX_SEED
from verbatim.errors import InputError


class EngineChoice(Frozen):
    """Which engine serves a run: the bundled in-process vLLM, or vLLM servers over HTTP (one per replica)."""

    kind: str = "inproc"
    model: str = "default"
    urls: tuple[str, ...] = ()
    route: str | None = None
    """Routing policy over the replicas (default sticky_least_loaded+group when there are several)."""
    high_water: float = Field(default=0.9, gt=0, le=1)
    admission: bool = True
    max_model_len: int = Field(default=DEFAULT_MAX_MODEL_LEN, ge=256)
    kv_cache_gib: int = Field(default=2, ge=1)
    gpu_memory: float | None = Field(default=None, gt=0, le=1)
    tensor_parallel: int = Field(default=1, ge=1)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)


def engine_choice(config: Any, seed: int) -> EngineChoice:
    """The engine a run's config (:class:`~verbatim.jobs.config.PlayConfig`: ``run``'s or ``train``'s) asks for,
    seeded with the run's seed."""
    return EngineChoice(kind=config.engine, model=config.model, urls=config.urls, route=config.route,
                        high_water=config.high_water, admission=config.admission, max_model_len=config.max_model_len,
                        kv_cache_gib=config.kv_cache_gib, seed=seed, gpu_memory=config.engine_gpu_memory,
                        tensor_parallel=config.engine_tensor_parallel)


def make_engine(choice: EngineChoice) -> Any:
    """The engine, constructed (constructing starts nothing); bad engine options are refused here."""
    if choice.kind == "inproc":
        if choice.urls or choice.route:
            raise InputError("--url and --route go with --engine http")
        from verbatim.engine.inproc import InprocEngine
        from verbatim.engine.runtime import EngineConfig

        return InprocEngine(EngineConfig(model=choice.model, max_model_len=choice.max_model_len,
                                         kv_cache_gib=choice.kv_cache_gib, seed=choice.seed,
                                         gpu_memory=choice.gpu_memory, tensor_parallel=choice.tensor_parallel))
    if choice.kind == "http":
        if not choice.urls:
            raise InputError("--engine http needs --url (one per replica)",
                             hint="start servers with 'verbatim fleet up'")
        from verbatim.engine.http import HttpEngine

        engines = [HttpEngine(url) for url in choice.urls]
        if len(engines) == 1 and choice.route is None:
            return engines[0]
        from verbatim.engine.routing import RouteConfig

        config = RouteConfig.parse(choice.route or "sticky_least_loaded+group", high_water=choice.high_water,
                                   admission=choice.admission)
        return Router(engines, config)
    raise InputError(f"unknown engine {choice.kind!r}", hint="use inproc or http")


def episode_source(env: str | None, agent: str | None, env_args: dict[str, Any] | None = None,
                   agent_cmd: str | None = None) -> Any:
    """What the rollouts play: the env factory ``--env`` names, the agent of ``--agent``, or the command of
    ``--agent-cmd`` (one of them)."""
    given = [name for name, value in (("--env", env), ("--agent", agent), ("--agent-cmd", agent_cmd)) if value]
    if len(given) != 1:
        raise InputError(f"give one of --env NAME, --agent FILE.py:FUNCTION or --agent-cmd \"CMD\""
                         f"{', not ' + ' and '.join(given) if given else ''}",
                         hint="--env plays an environment; --agent and --agent-cmd run your OpenAI-client agent")
    if env is None and env_args:
        raise InputError("--env-arg goes with --env")
    from verbatim.agents.loader import load_agent, load_agent_command

    if agent is not None:
        return load_agent(agent)
    if agent_cmd is not None:
        return load_agent_command(agent_cmd)
    from verbatim.envs.registry import load_env

    return load_env(env, **(env_args or {}))


def players(agent: str | None, model: str, timeout_s: float) -> Any:
    """The ``make_player`` of the run's plays: an env's rollout loop, or (``agent``: an --agent or --agent-cmd
    was given) the agent endpoint's."""
    if agent is None:
        from verbatim.harness.rollout import RolloutPlayer

        return RolloutPlayer
    from verbatim.agents.player import agent_players

    return agent_players(Path(model).name if model not in ("", "default") else DEFAULT_MODEL, timeout_s)


def default_renderer(model: str) -> str:
    """The bundled default's renderer, or the family a model folder's chat template is (renderers/detect.py)."""
    if model in ("default", "", DEFAULT_MODEL):
        return "smollm2"
    if Path(model).expanduser().is_dir():
        from verbatim.renderers.detect import detect_folder

        return detect_folder(Path(model).expanduser())
    raise InputError(f"no renderer is known for model {model!r}", hint="pass --renderer NAME (see docs/renderers.md)")


def existing_run_id(out: Path) -> str | None:
    """The run id of the run already in ``out``, if any (a resume keeps it)."""
    from verbatim.harness.store import read_manifest

    return read_manifest(out).run_id if (out / "manifest.json").exists() else None
