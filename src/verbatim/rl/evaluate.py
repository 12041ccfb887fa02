"""A training run's evaluations (``verbatim train --eval-every N``): the policy of one version on held-out tasks.

Before the first step, every N steps and after the last, the loop (rl/train.py) plays the run's evaluation tasks
K times each with the weights it has just pushed, into ``RUN_DIR/eval/step-{n:06d}/``: an ordinary run folder
(lint, show, view read it) whose rollouts never reach the trainer. Its figures (harness/evaluation.py: avg@K,
success rate, pass@k, with the version every sampled token carries, checked) go into step ``n``'s line of
``metrics.jsonl`` as its ``eval`` object; the evaluation before the first step has a line of its own, step 0.

The tasks are the same at every evaluation, and so are the sampling seeds (one set for all: a curve compares
versions, not draws). A resume plays what an evaluation left unplayed with the same weights (the checkpoint it
resumes from is the version that evaluation is of), and one that finished is read back, not played again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from verbatim.harness.evaluation import figures
from verbatim.harness.rollout import LoopConfig
from verbatim.harness.run import Run, RunPlan
from verbatim.harness.store import RunManifest
from verbatim.rl.plan import EvalPlan
from verbatim.rl.train_resume import EVAL_DIR


def eval_folder(out: Path, step: int) -> Path:
    """Where the evaluation of the weights after ``step`` (0: before the first) is written."""
    return Path(out) / EVAL_DIR / f"step-{step:06d}"


class Evaluator:
    """Plays a training run's evaluations on its engine."""

    def __init__(self, plan: EvalPlan, steps: int, tasks: Sequence[dict[str, Any]], loop: LoopConfig,
                 run_plan: RunPlan, engine: Any, env: Any, renderer: Any, manifest: RunManifest, out: Path,
                 make_player: Callable[..., Any]) -> None:
        self.plan, self.steps, self.tasks, self.loop = plan, steps, list(tasks), loop
        self.run_plan, self.engine, self.env, self.renderer, self.manifest = run_plan, engine, env, renderer, manifest
        self.out, self.make_player = Path(out), make_player

    def due(self, step: int) -> bool:
        return self.plan.due(step, self.steps)

    def run(self, step: int, version: int) -> Run:
        """The evaluation of ``version``, the weights after ``step``, as a run of its own folder."""
        plan = self.run_plan.model_copy(update={"run_id": f"{self.manifest.run_id}-eval-{step:06d}"})
        config = {"eval": self.plan.model_dump(mode="json"), "plan": plan.model_dump(exclude={"run_id"}),
                  "of_run": self.manifest.run_id, "step": step, "version": version}
        manifest = self.manifest.model_copy(update={"run_id": plan.run_id, "config": config})
        return Run(plan, self.loop, self.engine, self.renderer, self.env, self.tasks, eval_folder(self.out, step),
                   manifest, make_player=self.make_player)

    async def play(self, run: Run, version: int) -> dict[str, Any]:
        """Play what ``run`` has not written yet (nothing, for one that finished); its figures, of ``version``."""
        await run.play(resume=True)
        return figures(run.rollouts, self.plan.eval_pass_k, version)


def owes_evaluation(plan: EvalPlan, step: int, steps: int, lines: Sequence[dict[str, Any]]) -> bool:
    """The weights after ``step`` are due an evaluation and ``lines`` (metrics.jsonl's) record none for it."""
    return plan.due(step, steps) and not any(r.get("step") == step and "eval" in r for r in lines)


def eval_run_plan(plan: EvalPlan, tasks: int, seed: int, concurrency: int) -> RunPlan:
    """An evaluation's plan: a group per task, K samples each, sampling seeds the same at every evaluation."""
    return RunPlan(run_id="eval", groups=tasks, group_size=plan.eval_samples, seed=seed, concurrency=concurrency,
                   batch_size=max(plan.eval_samples, 4))
