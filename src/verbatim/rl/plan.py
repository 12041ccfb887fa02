"""What a training loop does around its learner: :class:`TrainPlan`, a setting of the run (no torch here:
the loop itself is :mod:`verbatim.rl.train`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from verbatim.datamodel import Frozen
from verbatim.engine.protocol import CachePolicy
from verbatim.engine.runtime import MAX_SEED
from verbatim.harness.pass_at_k import ks_fit
from verbatim.harness.run import RunPlan
from verbatim.trainer.advantages import Advantage


class TrainPlan(Frozen):
    """What the loop does around the learner (recorded in the run's config)."""

    steps: int = Field(default=10, ge=1)
    """Training steps (each: play, learn, push weights)."""
    groups: int = Field(default=2, ge=1)
    """Groups per step (one task each)."""
    group_size: int = Field(default=4, ge=2)
    """Rollouts per group (group-relative advantages need at least 2)."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """Seed of the env's tasks, of every request's sampling seed and of the trainer (docs/engine.md:
    reproducible sampling)."""
    advantage: Advantage = "grpo"
    """grpo: (r - mean) / (std + eps); rloo: r minus the mean of the group's other rewards; mean: r - mean
    (Dr. GRPO: no division by the std)."""
    cache_policy: CachePolicy = CachePolicy.KEEP_SALT
    """flush | keep | salt | keep+salt. keep+salt (docs/engine.md): a rollout keeps its own cache across an
    update, a new rollout never reads KV of older weights (run's default is keep: it pushes no weights)."""
    max_lag: int = Field(default=0, ge=0)
    """0: synchronous on-policy. L >= 1: the next step plays while this one trains; tokens more than L versions
    behind are masked."""
    fixed_lag: bool = False
    """With --max-lag L >= 1: step n samples with exactly the weights of step n-1-L (a push waits until the
    steps that need older weights have played), so a rerun repeats every version; without it, a push lands as
    soon as its step is trained."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Checkpoints kept under the run folder."""
    checkpoint_every: int = Field(default=10, ge=1)
    """Steps between checkpoints (the last step and a stopped run's last step always get one); a resume trains
    the steps after the newest checkpoint again. 1 checkpoints every step."""
    concurrency: int = Field(default=16, ge=1)
    """Live rollouts at most."""
    hold_out: bool = True
    """Train only on the env's tasks its held-out rule keeps, leaving the rest to evaluation (envs/held_out.py;
    --no-hold-out: every generated task, as runs recorded before the rule trained)."""
    allow_truncated_sampling: bool = False
    """Train on rollouts sampled under --top-p/--top-k, masks the trainer's π does not reproduce; each step's
    metrics count the sampled tokens outside π's mask (outside_support). Off, such a step is refused."""
    context: Literal["traced", "rerendered", "closed"] = "traced"
    """What the learner trains on: the traced tokens, or (ablations, rl/rerendered.py) each
    rollout's messages re-rendered by the chat template, without sampler logprobs, or the traced tokens
    with each reply cut by max tokens closed by a trained stop token, the re-render's one addition."""

    @property
    def versions_in_flight(self) -> int:
        """The policy versions whose requests may run at once: the newest, the ``max_lag`` before it a lagged step
        still samples with, one being pushed and one being evaluated (a LoRA run's adapters loaded at once)."""
        return self.max_lag + 3

    def task_seed(self, k: int) -> int:
        """The seed of the env's task generator for step ``k + 1`` (``k`` steps trained before it)."""
        return self.seed * 100_003 + k

    def run_plan(self, run_id: str, k: int) -> RunPlan:
        """What step ``k + 1`` plays (``k`` steps trained before it): its groups, ids ``s{k+1:04d}-…``."""
        return RunPlan(run_id=run_id, groups=self.groups, group_size=self.group_size, seed=self.seed,
                       concurrency=self.concurrency, batch_size=max(self.group_size, 4), step=k + 1)


class EvalPlan(Frozen):
    """When and on what a training run evaluates its policy: held-out tasks, K samples each (recorded in the run's
    config; rl/evaluate.py plays them)."""

    eval_every: int | None = Field(default=None, ge=1)
    """Evaluate on held-out tasks before the first step, every N steps and after the last, with the weights just
    pushed (RUN_DIR/eval/step-N; pass@k in metrics.jsonl's eval objects); default: no evaluation."""
    eval_groups: int | None = Field(default=None, ge=1)
    """Held-out tasks an evaluation plays (default: every task of --eval-tasks, else 8 from the env's held-out
    part)."""
    eval_samples: int = Field(default=4, ge=1)
    """Samples per held-out task (K): pass@k for k up to K."""
    eval_tasks: str | None = None
    """JSONL file of evaluation tasks (default: the env's held-out part, which training never draws from)."""
    eval_temperature: float | None = Field(default=None, ge=0)
    """Evaluation's sampling temperature (default: training's --temperature; 0 samples greedily)."""
    eval_pass_k: tuple[int, ...] = ()
    """The k of pass@k an evaluation reports beside pass@1, e.g. 2,4 (default: 1, the powers of two below K, and
    K)."""
    allow_overlap: bool = False
    """Evaluate on tasks equal to training tasks (the same file as --tasks and --eval-tasks): refused without it."""

    DEFAULT_GROUPS: ClassVar[int] = 8

    @model_validator(mode="after")
    def _ks_fit_the_samples(self) -> EvalPlan:
        ks_fit(self.eval_pass_k, self.eval_samples, "--eval-pass-k")
        return self

    def due(self, step: int, steps: int) -> bool:
        """Whether the weights after ``step`` (0: before the first) are evaluated in a run of ``steps`` steps."""
        every = self.eval_every
        return every is not None and (step == 0 or step % every == 0 or step == steps)
