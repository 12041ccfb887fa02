"""Environments: the Env protocol, the built-in envs and how to load envs and task files (docs/environments.md)."""

from verbatim.envs.base import Env, EnvFactory, Reset, StepResult
from verbatim.envs.registry import BUILTIN_ENVS, env_names, load_env
from verbatim.envs.taskfile import TaskSpec, load_tasks

__all__ = ["BUILTIN_ENVS", "Env", "EnvFactory", "Reset", "StepResult", "TaskSpec", "env_names", "load_env",
           "load_tasks"]
