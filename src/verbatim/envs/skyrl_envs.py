"""``--env skyrl:ID``: skyrl-gym's text environments (``BaseTextEnv``) as verbatim envs.

A task is one row of a skyrl-gym dataset as JSON: ``prompt`` (the opening messages), ``reward_spec``,
``extra_info`` and whatever else the env reads from its ``extras``; ``env_config`` (optional) is handed to
the env as its config. ``reset`` is the env's ``init(prompt)``; each ``step`` hands the env the model's
reply as text and passes its observations, per-turn reward (recorded on the turn, summed for the rollout)
and ``done`` through unchanged, with its metadata in the turn's info and ``get_metrics()`` at the end.

Refused, with the reason: an env that calls a language model or needs the network
(:mod:`verbatim.envs.library_rules`), and at run time an env that rewrites the model's reply
(``postprocessed_action``): the trace keeps replies as sampled, so the env would judge text the policy
never wrote. Install with ``pip install 'verbatim-rl[skyrl]'``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verbatim.datamodel import Message
from verbatim.envs.base import Reset, StepResult
from verbatim.envs.library_rules import entry_name, refuse_unfit, reply_text
from verbatim.errors import DependencyError, EnvError, InputError, install_hint

PREFIX = "skyrl:"


class SkyRLFactory:
    """Makes one skyrl-gym env per rollout; tasks come from ``--tasks``."""

    def __init__(self, env_id: str) -> None:
        try:
            import skyrl_gym
            from skyrl_gym.envs.registration import registry
        except ImportError:
            raise DependencyError("skyrl-gym is not installed",
                                  hint=install_hint("skyrl")) from None
        if env_id not in registry:
            raise InputError(f"skyrl-gym has no env {env_id!r}", hint=f"known: {', '.join(sorted(registry))}")
        refuse_unfit(Path(skyrl_gym.__file__).parent.parent, entry_name(registry[env_id].entry_point), "skyrl-gym",
                     env_id)
        self.env_id, self.name, self._make = env_id, f"{PREFIX}{env_id}", skyrl_gym.make

    def make(self) -> SkyRLEnv:
        return SkyRLEnv(self)

    def tasks(self, count: int, seed: int) -> Sequence[dict[str, Any]]:
        raise InputError(f"{self.name} has no task generator",
                         hint="give --tasks FILE: one skyrl-gym dataset row per line (prompt, reward_spec, …)")


class SkyRLEnv:
    def __init__(self, factory: SkyRLFactory) -> None:
        self.factory, self.name, self.env = factory, factory.name, None

    def reset(self, task: dict[str, Any], seed: int) -> Reset:
        prompt = task.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            raise InputError(f"{self.name} task: prompt must be a non-empty list of messages",
                             hint="a skyrl-gym dataset row: prompt, reward_spec, extra_info")
        extras = {"extra_info": {}, **{k: v for k, v in task.items() if k != "env_config"}}
        try:
            self.env = self.factory._make(self.factory.env_id, env_config=task.get("env_config"), extras=extras)
        except AssertionError as exc:  # skyrl-gym checks its task fields with assert
            raise InputError(f"{self.name} task: {exc}") from None
        messages, _ = self.env.init(prompt)
        return Reset(messages=tuple(_message(m) for m in messages))

    def step(self, message: Message) -> StepResult:
        action = reply_text(message)
        out = self.env.step(action)
        rewritten = out.get("postprocessed_action")
        if rewritten is not None and rewritten != action:
            raise EnvError(f"{self.name} rewrote the model's reply (postprocessed_action); verbatim keeps replies "
                           "as sampled and cannot train on text the policy did not write")
        info = {"metadata": out.get("metadata") or {}}
        if out["done"]:
            info["metrics"] = self.env.get_metrics()
            self.env.close()
        return StepResult(messages=tuple(_message(m) for m in out.get("observations") or ()),
                          reward=float(out["reward"]), done=bool(out["done"]), info=info)


def _message(data: dict[str, Any]) -> Message:
    return Message(role=data["role"], content=str(data.get("content") or ""))
