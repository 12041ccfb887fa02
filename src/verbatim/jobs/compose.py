"""The parts every run is composed of, from the names a user gives: what the rollouts play, who plays them,
the renderer, the engine. ``verbatim run`` and :mod:`verbatim.jobs.train` build their runs from these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verbatim.engine.models import DEFAULT_MODEL
from verbatim.engine.router import Router
from verbatim.errors import InputError
from verbatim.jobs.config import EngineChoice, PlaySource, Routing


def make_engine(choice: EngineChoice, routing: Routing, seed: int, lora: tuple[int, int] | None = None,
                record: str | None = None) -> Any:
    """The engine ``choice`` names, its requests spread by ``routing`` over several replicas and sampled under the
    run's ``seed``; constructing starts nothing, and bad engine options are refused here. ``lora``: (rank, slots)
    of the LoRA adapters it serves (a LoRA training run's). ``record``: the flag that has it record the routed
    experts (``--record-routing``, or ``--routing-replay``, which needs them), refused for a dense model."""
    record = record or ("--record-routing" if choice.record_routing else None)
    if record is not None and (choice.kind == "inproc" or record == "--routing-replay"):  # the trainer's model
        from verbatim.engine.expert_capture import check_moe

        check_moe(choice.model, record)
    if choice.kind == "inproc":
        if choice.urls or routing.route:
            raise InputError("--url and --route go with --engine http")
        from verbatim.engine.inproc import InprocEngine
        from verbatim.engine.precision import engine_dtype, this_device
        from verbatim.engine.runtime import EngineConfig

        device = this_device()
        return InprocEngine(EngineConfig(model=choice.model, device=device.kind,
                                         dtype=engine_dtype(choice.dtype, device), enforce_eager=choice.eager,
                                         max_model_len=choice.max_model_len, kv_cache_gib=choice.kv_cache_gib,
                                         seed=seed, gpu_memory=choice.gpu_memory,
                                         tensor_parallel=len(choice.gpus), devices=choice.devices,
                                         lora_rank=lora[0] if lora else None, lora_slots=lora[1] if lora else 4,
                                         record_experts=record is not None))
    if choice.dtype != "auto" or choice.eager is not None:
        flag = "--engine-dtype" if choice.dtype != "auto" else "--engine-eager"
        raise InputError(f"{flag} sets the in-process engine; a served engine's is set where it starts",
                         hint="verbatim serve --dtype …, verbatim fleet up --dtype …")
    if not choice.urls:  # --engine http
        raise InputError("--engine http needs --url (one per replica)",
                         hint="start servers with 'verbatim fleet up'")
    from verbatim.engine.http import HttpEngine

    engines = [HttpEngine(url, record_experts=record is not None) for url in choice.urls]
    if len(engines) == 1 and routing.route is None:
        return engines[0]
    from verbatim.engine.routing import RouteConfig

    config = RouteConfig.parse(routing.route or "sticky_least_loaded+group", high_water=routing.high_water,
                               admission=routing.admission)
    return Router(engines, config)


def engine_record(choice: EngineChoice, engine: Any, cache_policy: str, urls: list[str],
                  route: str | None) -> dict[str, Any]:
    """The manifest's ``engine`` object: what served the run, as run and train record it. ``dtype``: the
    in-process engine's format as resolved for its device (``--engine-dtype auto``: fp32 on a CPU, bf16 on a
    GPU); None for a served engine, whose format its server chose."""
    return {"kind": choice.kind, "block_size": engine.block_size, "cache_policy": cache_policy, "urls": urls,
            "route": route, "dtype": engine_dtype_of(engine)}


def engine_dtype_of(engine: Any) -> str | None:
    """An in-process engine's format, as vLLM names it (``bfloat16``); None for a served engine or a router."""
    from verbatim.engine.inproc import InprocEngine

    return engine.config.dtype if isinstance(engine, InprocEngine) else None


def episode_source(play: PlaySource) -> Any:
    """What the rollouts play: the env factory ``--env`` names, the agent of ``--agent``, or the command of
    ``--agent-cmd`` (one of them)."""
    given = [name for name, value in (("--env", play.env), ("--agent", play.agent), ("--agent-cmd", play.agent_cmd))
             if value]
    if len(given) != 1:
        raise InputError(f"give one of --env NAME, --agent FILE.py:FUNCTION or --agent-cmd \"CMD\""
                         f"{', not ' + ' and '.join(given) if given else ''}",
                         hint="--env plays an environment; --agent and --agent-cmd run your OpenAI-client agent")
    if play.env is None and play.env_args:
        raise InputError("--env-arg goes with --env")
    from verbatim.agents.loader import load_agent, load_agent_command

    if play.agent is not None:
        return load_agent(play.agent)
    if play.agent_cmd is not None:
        return load_agent_command(play.agent_cmd)
    from verbatim.envs.registry import load_env

    return load_env(play.env, **play.env_args)


def players(play: PlaySource, model: str) -> Any:
    """The ``make_player`` of the run's plays: an env's rollout loop, or the agent endpoint's (an --agent or
    --agent-cmd was given), for agents that name ``model``."""
    if play.player is None:
        from verbatim.harness.rollout import RolloutPlayer

        return RolloutPlayer
    from verbatim.agents.player import agent_players

    return agent_players(Path(model).name if model not in ("", "default") else DEFAULT_MODEL, play.agent_timeout_s)


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


def checkpoint_model(model: str) -> str:
    """The model folder ``model`` names: a training run's newest complete checkpoint for its run folder, a
    checkpoint folder only when it is complete; any other name as it is (engine/models.resolve judges it)."""
    from verbatim.rl.train_resume import CHECKPOINTS

    path = Path(model).expanduser()
    if not path.is_dir():
        return model
    if (path / "manifest.json").is_file() and not (path / "config.json").is_file():
        complete = _complete(path / CHECKPOINTS)
        if not complete:
            raise InputError(f"--model {model}: the run in {path} has no complete checkpoint to play",
                             hint="train it further (a checkpoint is written every --checkpoint-every steps and "
                                  "at the last), or give a model folder")
        return str(path / CHECKPOINTS / complete[-1])
    if path.parent.name == CHECKPOINTS and path.name.startswith("step-"):
        if path.name not in _complete(path.parent):
            raise InputError(f"--model {model} is not a complete checkpoint (its weights, optimizer or state.json "
                             "are missing)", hint=f"give one of the complete checkpoints in {path.parent}")
    return model


def playable_model(model: str) -> str:
    """:func:`checkpoint_model`'s folder where an engine can start on it: a LoRA run's checkpoint (a PEFT folder, the
    adapter alone) is refused in one line, naming how to make a model folder of it."""
    from verbatim.trainer.lora import is_adapter_folder

    chosen = checkpoint_model(model)
    if is_adapter_folder(Path(chosen)) and not (Path(chosen) / "config.json").is_file():
        raise InputError(f"--model {model}: {chosen} is a LoRA adapter, not a model an engine can start on",
                         hint=f"verbatim export-model {chosen} --merge --out DIR, then --model DIR")
    return chosen


def _complete(root: Path) -> list[str]:
    """The folder names of ``root``'s complete checkpoints, oldest first."""
    from verbatim.trainer.checkpoint import checkpoint_steps, step_dir_name

    return [step_dir_name(step) for step in checkpoint_steps(root)]
