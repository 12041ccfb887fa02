"""The flags of ``verbatim train`` and the options they build (the loop itself: cli/train.py).

Every flag of the RL loop is declared here, with its help, but those ``verbatim run`` takes alike (what plays,
the model, the engine: cli/play_flags.py); a value a settings model refuses is one line naming the flag
(:func:`~verbatim.cli.train.flag_errors`).
"""

from __future__ import annotations

import typer

from verbatim.cli import play_flags as flags
from verbatim.cli.console import console
from verbatim.engine.runtime import MAX_SEED
from verbatim.envs.registry import FALLBACK_MAX_TURNS


def train_flags(
    env: str = flags.ENV,
    agent: str = flags.AGENT,
    agent_cmd: str = flags.AGENT_CMD,
    agent_timeout: float = flags.AGENT_TIMEOUT,
    env_arg: list[str] = typer.Option([], "--env-arg", help="KEY=VALUE for the env's factory (repeat), e.g. "
                                                             "--env-arg high=5 for guess; values are JSON or text."),
    task_file: str = typer.Option(None, "--task-file", "--tasks",
                                  help="JSONL task file, taken in turn (default: the env's generator, "
                                       "seeded per step)."),
    steps: int = typer.Option(10, "--steps", help="Training steps (each: play, learn, push weights)."),
    groups: int = typer.Option(2, "--groups", help="Groups per step (one task each)."),
    group_size: int = typer.Option(4, "--group-size", help="Rollouts per group (at least 2)."),
    max_turns: int = typer.Option(None, "--max-turns", min=1,
                                  help="Model turns per rollout at most (default: as many as the env's tasks "
                                       f"allow, e.g. guess's guesses; {FALLBACK_MAX_TURNS} for an env that does "
                                       "not say)."),
    max_tokens: int = typer.Option(48, "--max-tokens", min=1, help="Sampled tokens per turn at most."),
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature (above 0); the trainer's "
                                                                  "π is log_softmax(logits / T) at it."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling (below 1 needs --allow-truncated-sampling)."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k likeliest tokens; 0 is off (above 0 needs "
                                                 "--allow-truncated-sampling)."),
    allow_truncated_sampling: bool = typer.Option(
        False, "--allow-truncated-sampling",
        help="Train on rollouts sampled under --top-p/--top-k, masks the trainer's π does not reproduce; each "
             "step's metrics count the sampled tokens outside π's mask (outside_support)."),
    lr: float = typer.Option(1e-5, "--lr", help="AdamW learning rate (of the first step)."),
    lr_schedule: str = typer.Option("constant", "--lr-schedule",
                                    help="constant | linear | cosine: from --lr at the first step to "
                                         "--lr × --lr-final at the last."),
    lr_final: float = typer.Option(0.1, "--lr-final", help="The last step's learning rate as a fraction of --lr "
                                                           "(linear and cosine)."),
    weight_decay: float = typer.Option(0.0, "--weight-decay", min=0.0, help="AdamW weight decay."),
    max_grad_norm: float = typer.Option(1.0, "--max-grad-norm", help="Clip the gradient norm of each update."),
    advantage: str = typer.Option("grpo", "--advantage", help="grpo: (r - mean) / (std + eps); rloo: r minus "
                                                              "the mean of the group's other rewards; mean: "
                                                              "r - mean (Dr. GRPO: no division by the std)."),
    normaliser: str = typer.Option("token", "--normaliser",
                                   help="token: the step's loss is a mean over all its trained tokens; "
                                        "sequence: a mean over sequences of each one's token mean."),
    updates_per_step: int = typer.Option(1, "--updates-per-step",
                                         help="Optimizer updates per step; above 1 the PPO clip on pi/pi_old "
                                              "applies (pi_old: the trainer at the step's start)."),
    clip_eps: float = typer.Option(0.2, "--clip-eps", help="PPO clip range of pi/pi_old."),
    kl_coef: float = typer.Option(0.0, "--kl-coef",
                                  help="Beta of a per-token penalty toward the starting model (a frozen copy "
                                       "the trainer keeps); 0: none (docs/trainer.md)."),
    kl_estimator: str = typer.Option("k3", "--kl-estimator",
                                     help="k3 (GRPO's; its value estimates KL(pi||ref), its gradient is "
                                          "KL(ref||pi)'s in expectation) | k2 (its gradient is KL(pi||ref)'s)."),
    cache_policy: str = typer.Option("keep+salt", "--cache-policy",
                                     help="flush | keep | salt | keep+salt. Default keep+salt (docs/engine.md): "
                                          "a rollout keeps its own cache across an update, a new rollout never "
                                          "reads KV of older weights."),
    max_lag: int = typer.Option(0, "--max-lag", min=0,
                                help="0: synchronous on-policy. L >= 1: the next step plays while this one "
                                     "trains; tokens more than L versions behind are masked."),
    fixed_lag: bool = typer.Option(False, "--fixed-lag",
                                   help="With --max-lag L >= 1: step n samples with exactly the weights of step "
                                        "n-1-L (a push waits until the steps that need older weights have "
                                        "played), so a rerun repeats every version; without it, a push lands "
                                        "as soon as its step is trained."),
    token_tis_cap: float = typer.Option(2.0, "--token-tis-cap", help="Token-level TIS: weight min(pi/mu, cap); "
                                                                     "0 turns it off."),
    sequence_tis: str = typer.Option(None, "--sequence-tis",
                                     help="Sequence-level TIS instead of token-level: product | geo_mean "
                                          "(then set --token-tis-cap 0)."),
    sequence_tis_cap: float = typer.Option(2.0, "--sequence-tis-cap",
                                           help="Sequence-level TIS: weight min(ratio, cap) (with --sequence-tis)."),
    token_mask_band: str = typer.Option("0.5,5", "--token-mask-band",
                                        help="Drop tokens whose pi/mu is outside LOW,HIGH; none turns it off."),
    sequence_mask_band: str = typer.Option(None, "--sequence-mask-band",
                                           help="Drop sequences whose geometric-mean ratio is outside LOW,HIGH."),
    prefixflow: bool = typer.Option(None, "--prefixflow/--no-prefixflow",
                                    help="Run each group's shared prompt through the trainer once per step "
                                         "(PrefixFlow). Default: where the model's family has an adapter "
                                         "(docs/trainer.md); --prefixflow requires one, --no-prefixflow trains "
                                         "whole sequences."),
    microbatch: int = typer.Option(4, "--microbatch", help="Rollouts per trainer forward/backward."),
    trainer_dtype: str = typer.Option("fp32", "--trainer-dtype",
                                      help="fp32 | bf16: bf16 runs the trainer's forward under bfloat16 autocast "
                                           "over fp32 weights and fp32 AdamW state (log π in fp32): less memory; "
                                           "faster only on a CPU with bfloat16 instructions (AVX512-BF16, AMX) or "
                                           "a GPU (docs/trainer.md)."),
    activation_checkpointing: bool = typer.Option(
        False, "--activation-checkpointing",
        help="Recompute each decoder layer's activations in the backward instead of keeping them: less "
             "memory, about one more forward of time."),
    prefix_activations: str = typer.Option("keep", "--prefix-activations",
                                           help="keep | recompute | cpu | disk: under PrefixFlow, where a group's "
                                                "shared prompt's activations wait for their backward. recompute "
                                                "keeps none and runs the prompt forward once more: the least "
                                                "memory, about a tenth more time (docs/benchmarks.md)."),
    logprob_chunk: int = typer.Option(512, "--logprob-chunk",
                                      help="Tokens whose logits (over the whole vocabulary) the trainer computes "
                                           "at once, forward and backward; 0: all of a microbatch's at once."),
    keep_checkpoints: int = typer.Option(2, "--keep-checkpoints", help="Checkpoints kept under RUN_DIR."),
    checkpoint_every: int = typer.Option(10, "--checkpoint-every",
                                         help="Steps between checkpoints (the last step and a stopped run's "
                                              "last step always get one); a resume trains the steps after the "
                                              "newest checkpoint again. 1 checkpoints every step."),
    seed: int = typer.Option(0, "--seed", min=0, max=MAX_SEED,
                             help="Seed of the env's tasks, of every request's sampling seed and of the trainer "
                                  "(docs/engine.md: reproducible sampling)."),
    model: str = flags.MODEL,
    renderer: str = flags.RENDERER,
    out: str = typer.Option("runs/train", "--out", help="Run directory: trace, metrics.jsonl, checkpoints/."),
    engine: str = flags.ENGINE,
    url: list[str] = flags.URL,
    route: str = typer.Option(None, "--route", help="Routing over several --url replicas (as for 'verbatim run')."),
    concurrency: int = flags.CONCURRENCY,
    max_model_len: int = flags.MAX_MODEL_LEN,
    kv_cache_gib: int = flags.KV_CACHE_GIB,
    engine_gpu_memory: float = flags.ENGINE_GPU_MEMORY,
    engine_tensor_parallel: int = flags.ENGINE_TENSOR_PARALLEL,
    trainer_device: str = typer.Option("cpu", "--trainer-device",
                                       help="Where the trainer's model runs: cpu, cuda or cuda:N (the engine "
                                            "places itself; weights reach it through CPU memory)."),
    trainer_procs: int = typer.Option(1, "--trainer-procs", min=1,
                                      help="Trainer processes the model is sharded over (FSDP2: gloo on the CPU, "
                                           "NCCL on GPUs); under torchrun, leave it out. docs/scale.md."),
    trainer_timeout: float = typer.Option(600.0, "--trainer-timeout", min=1,
                                          help="Seconds a step's collectives wait for a silent trainer rank before "
                                               "the run stops naming it (--trainer-procs > 1 or torchrun)."),
    resume: bool = typer.Option(False, "--resume", help="Go on from the last checkpoint (after a stop or a kill)."),
    log: list[str] = typer.Option([], "--log", help=flags.LOG_HELP),
    summary_json: str = flags.SUMMARY_JSON,
    config: str = flags.CONFIG,
) -> None:
    """Train the model with RL on its own token-exact rollouts: play, learn, push weights, repeat."""
    from verbatim.cli.train import (
        advantage_option,
        cache_policy_option,
        flag_errors,
        group_size_option,
        lr_schedule_option,
        parse_band,
        parse_env_args,
        sequence_tis_option,
        train_command,
    )
    from verbatim.jobs.train import TrainConfig
    from verbatim.rl.train import TrainPlan
    from verbatim.trainer.correction import CorrectionConfig
    from verbatim.trainer.learner import LearnerConfig
    from verbatim.trainer.objective import LossConfig

    dtype = trainer_dtype_option(trainer_dtype)

    with flag_errors():  # a value a settings model refuses: one line naming the option
        plan = TrainPlan(steps=steps, groups=groups, group_size=group_size_option(group_size), seed=seed,
                         advantage=advantage_option(advantage), cache_policy=cache_policy_option(cache_policy),
                         max_lag=max_lag, fixed_lag=fixed_lag, keep_checkpoints=keep_checkpoints,
                         checkpoint_every=checkpoint_every, concurrency=concurrency,
                         allow_truncated_sampling=allow_truncated_sampling)
        correction = CorrectionConfig(token_tis_cap=token_tis_cap or None,
                                      sequence_tis=sequence_tis_option(sequence_tis, token_tis_cap),
                                      sequence_tis_cap=sequence_tis_cap,
                                      token_mask_band=parse_band(token_mask_band, "--token-mask-band"),
                                      sequence_mask_band=parse_band(sequence_mask_band, "--sequence-mask-band"))
        learner = LearnerConfig(lr=lr, lr_schedule=lr_schedule_option(lr_schedule), lr_final=lr_final,
                                weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                                updates_per_step=updates_per_step, microbatch=microbatch, prefixflow=prefixflow,
                                dtype=dtype, checkpoint_layers=activation_checkpointing,
                                logprob_chunk=logprob_chunk,
                                prefix_activations=prefix_activations_option(prefix_activations),
                                loss=LossConfig(normaliser=normaliser, clip_eps=clip_eps, kl_coef=kl_coef,
                                                kl_estimator=kl_estimator),
                                correction=correction)
        options = TrainConfig(env=env, agent=agent, agent_cmd=agent_cmd, agent_timeout_s=agent_timeout,
                               env_args=parse_env_args(env_arg), tasks=task_file, model=model,
                               renderer=renderer, max_turns=max_turns, max_tokens=max_tokens, temperature=temperature,
                               top_p=top_p, top_k=top_k, plan=plan, learner=learner, out=out, engine=engine,
                               urls=tuple(url), route=route,
                               max_model_len=max_model_len, kv_cache_gib=kv_cache_gib,
                               engine_gpu_memory=engine_gpu_memory, engine_tensor_parallel=engine_tensor_parallel,
                               trainer_device=trainer_device, trainer_procs=trainer_procs,
                               trainer_timeout_s=trainer_timeout, resume=resume, log=tuple(log))
    train_command(options, console, summary_json)


def trainer_dtype_option(value: str) -> str:
    """``--trainer-dtype``: fp32 or bf16, else one line."""
    from verbatim.errors import InputError

    if value not in ("fp32", "bf16"):
        raise InputError(f"unknown --trainer-dtype {value!r}", hint="use fp32 or bf16")
    return value


def prefix_activations_option(value: str) -> str:
    """``--prefix-activations``: keep, recompute, cpu or disk, else one line."""
    from verbatim.errors import InputError
    from verbatim.trainer.prefix_offload import OFFLOADS

    if value not in OFFLOADS:
        raise InputError(f"unknown --prefix-activations {value!r}", hint=f"use one of {', '.join(OFFLOADS)}")
    return value
