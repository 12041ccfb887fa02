"""The flags ``verbatim run`` and ``verbatim train`` share, declared once so both take them alike (name, default,
bounds, help): what plays, on which model and engine, and the files and trackers a run also writes to.

Typer reads each declaration as a parameter's default and never changes it, so one declaration serves both.
"""

from __future__ import annotations

import typer

from verbatim.cli.config_file import CONFIG_HELP, load_config
from verbatim.engine.runtime import DEFAULT_MAX_MODEL_LEN

AGENT_HELP = ("Your agent instead of --env: FILE.py:FUNCTION or module:function, called per rollout as "
              "FUNCTION(task, client) with an OpenAI client of a token-exact endpoint; returns the reward.")
LOG_HELP = ("Also send each step's metrics, the config and a table of sampled rollouts to this tracker: wandb, "
            "tensorboard, mlflow or trackio (repeat for several; pip install 'verbatim[NAME]'). docs/trainer.md.")
AGENT_CMD_HELP = ("Your agent as a command in any language, run per rollout with OPENAI_BASE_URL and OPENAI_API_KEY "
                  "set and the task as JSON on stdin; its last stdout line is the reward or {\"reward\": …}.")

ENV = typer.Option(None, "--env", help="Built-in env (guess, tools, longdoc, python), module:Class, or entry point.")
AGENT = typer.Option(None, "--agent", help=AGENT_HELP)
AGENT_CMD = typer.Option(None, "--agent-cmd", help=AGENT_CMD_HELP)
AGENT_TIMEOUT = typer.Option(600.0, "--agent-timeout", min=0.001,
                             help="Seconds an --agent rollout may take; past it the rollout is an error.")
MODEL = typer.Option("default", "--model", help="Bundled model name or Hugging Face folder.")
RENDERER = typer.Option(None, "--renderer", help="Chat format (default: the model's own).")
ENGINE = typer.Option("inproc", "--engine", help="inproc (bundled vLLM) or http.")
URL = typer.Option([], "--url", help="vLLM server URL (with --engine http); repeat for replicas.")
CONCURRENCY = typer.Option(16, "--concurrency", min=1, help="Live rollouts at most.")
MAX_MODEL_LEN = typer.Option(DEFAULT_MAX_MODEL_LEN, "--max-model-len", min=256,
                             help="Context length per request: prompt + sampled tokens.")
KV_CACHE_GIB = typer.Option(2, "--kv-cache-gib", min=1, help="KV cache size in GiB (inproc engine).")
ENGINE_GPU_MEMORY = typer.Option(None, "--engine-gpu-memory",
                                 help="Share of each of its GPUs the in-process engine may take, in (0, 1] (vLLM's "
                                      "gpu_memory_utilization; default vLLM's, 0.92); docs/scale.md.")
ENGINE_TENSOR_PARALLEL = typer.Option(1, "--engine-tensor-parallel", min=1,
                                      help="GPUs the in-process engine spans (vLLM's tensor_parallel_size): GPUs "
                                           "0..N-1 of those this command sees.")
SUMMARY_JSON = typer.Option(None, "--summary-json", help="Also write the summary as JSON here.")
CONFIG = typer.Option(None, "--config", is_eager=True, callback=load_config, help=CONFIG_HELP)
