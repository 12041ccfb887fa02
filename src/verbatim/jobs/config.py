"""The config of a run: what ``verbatim run`` plays (:class:`RunOptions`) and what ``verbatim train`` trains
(:class:`TrainConfig`), both from :class:`PlayConfig`, and their flags (:data:`RUN_FLAGS`, :data:`TRAIN_FLAGS`).

Every default, bound and help text is written here once, as the field's default, ``Field`` bounds and
docstring; the CLI's flags, ``--config`` files, the run folder's ``config.toml`` and a resume's check all
derive from these models through :mod:`verbatim.jobs.flag_table`.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from verbatim.datamodel import Frozen
from verbatim.engine.precision import EngineDtype
from verbatim.engine.protocol import CachePolicy, Sampling
from verbatim.engine.runtime import DEFAULT_MAX_MODEL_LEN, MAX_SEED
from verbatim.engine.server_url import redact
from verbatim.errors import InputError
from verbatim.harness.pass_at_k import ks_fit
from verbatim.jobs.flag_table import DERIVED, FlagTable, Spec, put
from verbatim.rl.plan import EvalPlan, TrainPlan
from verbatim.trackers.fanout import TrackerNames
from verbatim.trainer.learner_config import LearnerConfig


def _default(model: type[Frozen], field: str, value: Any) -> Any:
    """``model``'s field with another default (its bounds and help kept), for a job's own section."""
    info = copy.copy(model.model_fields[field])
    info.default = value
    return info


class PlaySource(Frozen):
    """What the rollouts play: an env or an agent, its tasks, and the chat format its turns are rendered in."""

    env: str | None = None
    """Built-in env (guess, tools, longdoc, python), module:Class, or entry point."""
    agent: str | None = None
    """Your agent instead of --env: FILE.py:FUNCTION or module:function, called per rollout as
    FUNCTION(task, client) with an OpenAI client of a token-exact endpoint; returns the reward."""
    agent_cmd: str | None = None
    """Your agent as a command in any language, run per rollout with OPENAI_BASE_URL and OPENAI_API_KEY set and
    the task as JSON on stdin; its last stdout line is the reward or {"reward": …}."""
    agent_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds an --agent rollout may take; past it the rollout is an error."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """KEY=VALUE for the env's factory (repeat), e.g. --env-arg high=5 for guess; values are JSON or text."""
    tasks: str | None = None
    """JSONL task file, taken in turn (default: the env's seeded generator; --agent needs one)."""
    renderer: str | None = None
    """Chat format (default: the model's own)."""
    max_turns: int | None = Field(default=None, ge=1)
    """Model turns per rollout at most; a rollout cut here is 'truncated' (default: as many as the env's tasks
    allow, e.g. guess's 6 guesses; 8 for an env that does not say)."""

    @property
    def player(self) -> str | None:
        """The agent a rollout is played by (--agent or --agent-cmd), None for an env's own loop."""
        return self.agent or self.agent_cmd


class SamplingConfig(Frozen):
    """How each turn samples."""

    max_tokens: int = Field(default=64, ge=1)
    """Sampled tokens per turn at most (default: 64 for run, 48 for train, whose every step plays and then
    learns on every token)."""
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature; 0 is greedy (not for training: the trainer's π is log_softmax(logits / T))."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling (training below 1 needs --allow-truncated-sampling)."""
    top_k: int = Field(default=0, ge=0)
    """Sample among the k likeliest tokens; 0 is off (training above 0 needs --allow-truncated-sampling)."""

    def sampling(self) -> Sampling:
        """These settings as every request of the run carries them."""
        return Sampling(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


class EngineChoice(Frozen):
    """Which engine serves the run and the model it serves: the bundled in-process vLLM, or vLLM servers over
    HTTP (one per replica)."""

    kind: Literal["inproc", "http"] = "inproc"
    """inproc (bundled vLLM) or http."""
    model: str = "default"
    """Bundled model name or Hugging Face folder; for run and eval also a training run's folder (its newest
    checkpoint) or one of its checkpoints, RUN_DIR/checkpoints/step-N."""
    urls: tuple[str, ...] = ()
    """vLLM server URL (with --engine http); repeat for replicas."""
    max_model_len: int = Field(default=DEFAULT_MAX_MODEL_LEN, ge=256)
    """Context length per request: prompt + sampled tokens."""
    kv_cache_gib: int = Field(default=2, ge=1)
    """KV cache size in GiB (inproc engine)."""
    gpu_memory: float | None = Field(default=None, gt=0, le=1)
    """Share of each of its GPUs the in-process engine may take, in (0, 1] (vLLM's gpu_memory_utilization;
    default vLLM's, 0.92); docs/scale.md."""
    tensor_parallel: int = Field(default=1, ge=1)
    """GPUs the in-process engine spans (vLLM's tensor_parallel_size): GPUs 0..N-1 of those this command
    sees."""
    devices: tuple[int, ...] | None = None
    """The GPUs the in-process engine takes, by index among those this command sees, e.g. 0,1 (its tensor
    parallelism is their number); default: GPUs 0..N-1 for --engine-tensor-parallel N."""
    dtype: EngineDtype = "auto"
    """The in-process engine's number format: auto is fp32 on a CPU (sampler logprobs close to the trainer's)
    and bf16 on a GPU (fp16 before compute capability 8.0). Pushed weights are cast to it."""
    eager: bool | None = None
    """Run the in-process engine eagerly, without CUDA graphs (default: eager on a CPU, CUDA graphs on a
    GPU)."""
    record_routing: bool = False
    """Record the experts a MoE's router chose for every token (routed_experts in the trace: what
    --routing-replay replays); the in-process engine runs eagerly; a server must be started with it too."""

    @model_validator(mode="after")
    def _devices_set_the_parallelism(self) -> EngineChoice:
        if self.devices is not None and self.tensor_parallel not in (1, len(self.devices)):
            raise ValueError(f"--engine-devices {show_devices(self.devices)} names {len(self.devices)} GPUs but "
                             f"--engine-tensor-parallel is {self.tensor_parallel}: leave it out, the devices say it")
        return self

    @property
    def gpus(self) -> tuple[int, ...]:
        """The GPUs the in-process engine takes (on a machine with GPUs): --engine-devices, else 0..N-1."""
        return self.devices if self.devices is not None else tuple(range(self.tensor_parallel))


class Routing(Frozen):
    """How requests spread over several --url replicas."""

    route: str | None = None
    """Routing over several --url replicas: round_robin | least_loaded | session_hash | sticky_least_loaded,
    optionally +group (default with several: sticky_least_loaded+group)."""
    high_water: float = Field(default=0.9, gt=0, le=1)
    """Hold new rollouts while a replica's KV usage is at or above this."""
    admission: bool = True
    """KV admission control (router)."""


class Output(Frozen):
    """Where the run is written, and who else is told."""

    out: str = "runs/latest"
    """Run directory (written incrementally)."""
    resume: bool = False
    """Go on with the run in --out (after a stop or a kill) without redoing what it recorded."""
    log: TrackerNames = ()
    """Also send the run's metrics, its config and a table of sampled rollouts to this tracker: wandb,
    tensorboard, mlflow or trackio (repeat for several; pip install 'verbatim-rl[NAME]'). docs/trainer.md."""


class PlayConfig(Frozen):
    """What plays, how it samples, on which engine and routes, and where it is written: the sections ``run`` and
    ``train`` share."""

    play: PlaySource = Field(default_factory=PlaySource)
    """What the rollouts play."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """How each turn samples."""
    engine: EngineChoice = Field(default_factory=EngineChoice)
    """The engine and its model."""
    routing: Routing = Field(default_factory=Routing)
    """Routing over replicas."""
    output: Output = Field(default_factory=Output)
    """The run folder and trackers."""

    may_change: ClassVar[tuple[str, ...]] = ("output.resume", "output.out", "output.log", "engine.gpu_memory",
                                             "engine.tensor_parallel", "engine.devices", "engine.eager")
    """Fields a resume may change (dotted paths): where the run is written, where its engine runs, its
    trackers."""

    def recorded(self) -> Any:
        """This config as a run folder records it: no credentials in its server URLs."""
        engine = self.engine.model_copy(update={"urls": tuple(redact(u) for u in self.engine.urls)})
        return self.model_copy(update={"engine": engine})

    def settings(self) -> dict[str, Any]:
        """What a ``--resume`` must match: the recorded config without :attr:`may_change`."""
        return self.recorded().model_dump(mode="json", exclude=_exclusion(self.may_change))


class RunOptions(PlayConfig):
    """Everything ``verbatim run`` was asked to do (recorded in the manifest and ``config.toml``)."""

    groups: int | None = Field(default=None, ge=1)
    """Tasks, one group each (default: every task of --tasks, else 2 from the env's generator)."""
    group_size: int = Field(default=4, ge=1)
    """Rollouts per group (G)."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """Seed of the env's tasks and of every request's sampling seed (same seed, same tasks and draws;
    docs/engine.md)."""
    cache_policy: CachePolicy = CachePolicy.KEEP
    """flush | keep | salt | keep+salt (docs/engine.md). A run pushes no weights, so the four keep the same KV;
    keep, its default, sends no salt (train's default is keep+salt: its updates are where they differ)."""
    concurrency: int = Field(default=16, ge=1)
    """Live rollouts at most."""
    stop_grace_s: float = Field(default=30.0, ge=0)
    """On SIGINT/SIGTERM, seconds the playing rollouts get to finish."""

    may_change: ClassVar[tuple[str, ...]] = (*PlayConfig.may_change, "stop_grace_s")
    DEFAULT_GROUPS: ClassVar[int] = 2
    """Groups played from the env's own task generator when --groups is not given."""
    HELD_OUT: ClassVar[bool] = False
    """Whether the env's generated tasks are its held-out part (an evaluation's), not all of them."""
    COMMAND: ClassVar[str] = "run"
    """The command these options are of (the run folder's config.toml names it)."""


class EvalOutput(Output):
    """Where an evaluation is written, and who else is told."""

    out: str = _default(Output, "out", "runs/eval")


class EvalOptions(RunOptions):
    """Everything ``verbatim eval`` was asked to do: a run whose groups are held-out tasks, each played K times,
    scored by pass@k (recorded in the manifest and ``config.toml``)."""

    groups: int | None = Field(default=None, ge=1)
    """Tasks (default: every task of --tasks, else 8 from the env's held-out part, which training never draws
    from)."""
    group_size: int = Field(default=4, ge=1)
    """Samples per task (K): pass@k for k up to K."""
    pass_k: tuple[int, ...] = ()
    """The k of pass@k to report beside pass@1, e.g. 2,4 (default: 1, the powers of two below K, and K)."""
    output: EvalOutput = Field(default_factory=EvalOutput)
    """The run folder and trackers."""

    DEFAULT_GROUPS: ClassVar[int] = EvalPlan.DEFAULT_GROUPS
    HELD_OUT: ClassVar[bool] = True
    COMMAND: ClassVar[str] = "eval"

    @model_validator(mode="after")
    def _ks_fit_the_samples(self) -> EvalOptions:
        ks_fit(self.pass_k, self.group_size, "--pass-k")
        return self


class TrainSampling(SamplingConfig):
    """How each turn of a training run samples: shorter replies by default, and never greedily."""

    max_tokens: int = _default(SamplingConfig, "max_tokens", 48)

    @field_validator("temperature")
    @classmethod
    def _samples(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("must be above 0: the trainer's π is log_softmax(logits / T), which greedy "
                             "decoding has not")
        return value


class TrainOutput(Output):
    """Where a training run is written, and who else is told."""

    out: str = _default(Output, "out", "runs/train")


class Placement(Frozen):
    """Where the trainer runs and how weights reach the engine."""

    trainer_device: str = "cpu"
    """Where the trainer's model runs: cpu, cuda or cuda:N (the engine places itself; weights reach it through
    CPU memory); a resumed run may move."""
    trainer_devices: tuple[int, ...] | None = None
    """The GPUs of the trainer's ranks on each machine, in local-rank order, e.g. 2,3,4,5,6,7: local rank i trains
    on the i-th (default: --trainer-device; cuda under torchrun or --trainer-procs is GPU LOCAL_RANK)."""
    trainer_procs: int = Field(default=1, ge=1)
    """Trainer processes the model is sharded over (FSDP2: gloo on the CPU, NCCL on GPUs); under torchrun,
    leave it out. docs/scale.md."""
    weight_sync: Literal["memory", "folder"] = "memory"
    """How each step's weights reach an in-process engine: through shared memory, or as a published folder the
    engine reloads (a served engine's way, always taken with --engine http; slower, bench step's "before")."""
    trainer_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds a step's collectives wait for a silent trainer rank before the run stops naming it
    (--trainer-procs > 1 or torchrun)."""

    @model_validator(mode="after")
    def _one_way_to_name_the_device(self) -> Placement:
        if self.trainer_devices is not None and self.trainer_device not in ("cpu", "cuda"):
            raise ValueError(f"--trainer-device {self.trainer_device} and --trainer-devices "
                             f"{show_devices(self.trainer_devices)} both place the trainer: give one")
        return self


class TrainConfig(PlayConfig):
    """Everything a training run is asked to do: what plays (as for ``run``), the loop's plan, the learner and
    where the trainer runs (its ``train`` section is the run's recorded config)."""

    sampling: TrainSampling = Field(default_factory=TrainSampling)
    """How each turn samples."""
    output: TrainOutput = Field(default_factory=TrainOutput)
    """The run folder and trackers."""
    plan: TrainPlan = Field(default_factory=TrainPlan)
    """What the loop does around the learner."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """How the trainer steps."""
    placement: Placement = Field(default_factory=Placement)
    """Where the trainer runs."""
    evaluation: EvalPlan = Field(default_factory=EvalPlan)
    """When and on what the run evaluates its policy."""

    @model_validator(mode="after")
    def _version_lag_mask_follows_max_lag(self) -> TrainConfig:
        """The correction drops tokens more than ``plan.max_lag`` versions old: the number is the plan's, and the
        learner's ``correction.max_version_lag`` is derived from it here (one left out), never set apart."""
        held = self.learner.correction.max_version_lag
        derived = self.plan.max_lag if self.learner.correction.version_lag_mask else None
        if held is not None and held != derived:
            raise ValueError(f"learner.correction.max_version_lag {held} differs from {derived} (plan.max_lag "
                             f"{self.plan.max_lag}, the version-lag mask {'on' if derived is not None else 'off'}): "
                             "leave it out, the version-lag mask follows max_lag")
        if held is None and derived is not None:
            correction = self.learner.correction.model_copy(update={"max_version_lag": derived})
            object.__setattr__(self, "learner", self.learner.model_copy(update={"correction": correction}))
        return self

    may_change: ClassVar[tuple[str, ...]] = (*PlayConfig.may_change, "placement.trainer_device",
                                             "placement.trainer_devices",
                                             "placement.trainer_procs", "placement.trainer_timeout_s")

    def config(self) -> dict[str, Any]:
        """What a --resume must match (the output path, where the engine and the trainer run, and --resume
        itself excluded: a resumed run may move)."""
        return {"train": {k: v for k, v in self.settings().items() if v != {}}}  # an emptied section: no setting


def _exclusion(paths: tuple[str, ...]) -> dict[str, Any]:
    """Dotted field paths as pydantic's nested ``exclude``: ``{"output": {"out": True}}``."""
    tree: dict[str, Any] = {}
    for path in paths:
        put(tree, tuple(path.split(".")), True)
    return tree


def parse_band(text: str | None) -> tuple[float, float] | None:
    """``LOW,HIGH`` (0 <= LOW < HIGH) or ``none``."""
    if text is None or text.strip().lower() in ("none", "off", ""):
        return None
    try:
        low, high = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError("must look like LOW,HIGH (e.g. 0.5,5) or none") from None
    return (low, high)


def show_band(band: tuple[float, float] | None) -> str:
    return "none" if band is None else f"{band[0]:g},{band[1]:g}"


def parse_env_args(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; a value is read as JSON (numbers, true/false, lists) or else kept as text."""
    args: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise InputError(f"--env-arg {item!r} must look like KEY=VALUE (e.g. high=5)")
        if _non_finite(value):  # JSON's NaN/Infinity and float()'s inf/nan alike
            raise InputError(f"--env-arg {item!r}: {value.strip()} is not a finite number")
        try:
            args[key.strip()] = json.loads(value)
        except ValueError:
            args[key.strip()] = value
    return args


def _non_finite(text: str) -> bool:
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False


def device_list(text: str | None, flag: str = "--devices") -> tuple[int, ...] | None:
    """``0,1,2,3``: GPU indices, or None when not given."""
    if text is None:
        return None
    try:
        devices = tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise InputError(f"{flag} {text!r} must be GPU indices separated by commas (e.g. 0,1)") from None
    if any(d < 0 for d in devices):
        raise InputError(f"{flag} {text!r}: a GPU index is 0 or more")
    return devices


def show_devices(devices: tuple[int, ...] | None) -> str | None:
    return None if devices is None else ",".join(str(d) for d in devices)


def parse_ks(text: str | None) -> tuple[int, ...]:
    """``1,4,8``: the k of pass@k; empty or left out: the default."""
    if text is None or not str(text).strip():
        return ()
    try:
        return tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise ValueError("must be whole numbers separated by commas (e.g. 1,4)") from None


def show_ks(ks: tuple[int, ...]) -> str | None:
    return ",".join(str(k) for k in ks) or None


def parse_names(text: str | None) -> tuple[str, ...] | None:
    """``q_proj,v_proj``: module names; left out: None (the default)."""
    if text is None:
        return None
    return tuple(part.strip() for part in str(text).split(",") if part.strip())


def _off_is_none(text: str | None) -> str | None:
    return None if text is None or text.strip().lower() in ("none", "off", "") else text


PLAY_SPECS = {
    "play.agent_timeout_s": Spec(name="--agent-timeout"),
    "play.env_args": Spec(name="--env-arg", kind=str, multiple=True, parse=parse_env_args,
                          show=lambda args: [f"{k}={json.dumps(v)}" for k, v in args.items()]),
    "play.tasks": Spec(aliases=("--task-file",)),
    "engine.kind": Spec(name="--engine"),
    "engine.urls": Spec(name="--url"),
    "engine.gpu_memory": Spec(name="--engine-gpu-memory"),
    "engine.tensor_parallel": Spec(name="--engine-tensor-parallel"),
    "engine.devices": Spec(name="--engine-devices", kind=str, multiple=False, show=show_devices,
                           parse=lambda text: device_list(text, "--engine-devices")),
    "engine.dtype": Spec(name="--engine-dtype"),
    "engine.eager": Spec(name="--engine-eager"),
    "engine.record_routing": Spec(name="--record-routing"),
}
RUN_SPECS = {**PLAY_SPECS, "stop_grace_s": Spec(name="--stop-grace")}
KS_SPEC = Spec(kind=str, multiple=False, parse=parse_ks, show=show_ks)
"""A list of k for pass@k, written ``1,4``."""
EVAL_SPECS = {**RUN_SPECS, "group_size": Spec(name="--samples"), "pass_k": KS_SPEC}
TRAIN_SPECS = {
    **PLAY_SPECS,
    "placement.trainer_timeout_s": Spec(name="--trainer-timeout"),
    "placement.trainer_devices": Spec(kind=str, multiple=False, show=show_devices,
                                      parse=lambda text: device_list(text, "--trainer-devices")),
    "plan.context": DERIVED,  # an ablation of bench learn's, not a setting of a run
    "learner.dtype": Spec(name="--trainer-dtype"),
    "learner.checkpoint_layers": Spec(name="--activation-checkpointing"),
    "learner.correction.token_tis_cap": Spec(parse=lambda cap: cap or None, show=lambda cap: cap or 0.0),
    "learner.correction.token_mask_band": Spec(kind=str, parse=parse_band, show=show_band),
    "learner.correction.sequence_mask_band": Spec(kind=str, parse=parse_band, show=show_band),
    "learner.correction.sequence_tis": Spec(parse=_off_is_none),
    "learner.correction.max_version_lag": DERIVED,  # follows --max-lag
    "evaluation.eval_pass_k": KS_SPEC,
    "learner.routing_replay": Spec(name="--routing-replay"),
    "learner.lora.rank": Spec(name="--lora-rank"),
    "learner.lora.alpha": Spec(name="--lora-alpha"),
    "learner.lora.dropout": Spec(name="--lora-dropout"),
    "learner.lora.targets": Spec(name="--lora-targets", kind=str, multiple=False, parse=parse_names,
                                 show=lambda names: ",".join(names) if names else None),
}


@functools.cache
def flags_of(kind: type[PlayConfig]) -> FlagTable:
    """The flag table of a config class: ``RunOptions``'s, ``TrainConfig``'s, or a subclass's (its own fields are
    flags by the rule)."""
    specs = TRAIN_SPECS if issubclass(kind, TrainConfig) else EVAL_SPECS if issubclass(kind, EvalOptions) \
        else RUN_SPECS
    return FlagTable(kind, specs)


RUN_FLAGS = flags_of(RunOptions)
EVAL_FLAGS = flags_of(EvalOptions)
TRAIN_FLAGS = flags_of(TrainConfig)
