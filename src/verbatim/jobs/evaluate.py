"""An evaluation from one config: :class:`~verbatim.jobs.config.EvalOptions` and :func:`run_eval`.

``verbatim eval`` is ``verbatim run`` with each group one held-out task and its members the task's K samples
(``--samples``): the same env, agent, task and sampling flags, the same token-exact trace (lint, show, view and
export read it), then the figures of harness/evaluation.py (avg@K, success rate, pass@k). The model may be a
training run's checkpoint (jobs/compose.checkpoint_model): ``--model RUN_DIR`` plays its newest,
``--model RUN_DIR/checkpoints/step-N`` that one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console

from verbatim.errors import InputError
from verbatim.harness.evaluation import figures
from verbatim.harness.run import Run
from verbatim.harness.summary import RunSummary
from verbatim.jobs.config import EvalOptions, TrainConfig
from verbatim.jobs.run import run_rollouts


def run_eval(options: EvalOptions, console: Console | None = None, *,
             on_end: Callable[[Run], None] | None = None,
             engine: Any | None = None) -> tuple[RunSummary, dict[str, Any]]:
    """Play the evaluation ``options`` describe (:func:`~verbatim.jobs.run.run_rollouts`); returns its run
    summary and its figures, computed from the rollouts it wrote. ``on_end`` sees the run however it ends."""
    ended: list[Run] = []

    def end(run: Run) -> None:
        ended.append(run)
        if on_end is not None:
            on_end(run)

    summary = run_rollouts(options, console, on_end=end, engine=engine)
    return summary, figures(ended[0].rollouts, options.pass_k)


def training_eval_tasks(options: TrainConfig, factory: Any, training: Callable[[int], list[dict[str, Any]]],
                        ) -> list[dict[str, Any]] | None:
    """The tasks a training run evaluates on (``--eval-every``), None without evaluation: ``--eval-tasks`` or the
    env's held-out part (envs/held_out.py). Tasks equal to one the run trains on are refused unless
    ``--allow-overlap``; an env whose rule holds its part out is not searched, it cannot overlap."""
    from verbatim.envs.held_out import eval_tasks, overlap, rule_of
    from verbatim.envs.registry import load_tasks

    plan = options.evaluation
    if plan.eval_every is None:
        return None
    if plan.eval_tasks is not None:
        pool = load_tasks(plan.eval_tasks)
        groups = plan.eval_groups or len(pool)
        if groups > len(pool):
            raise InputError(f"--eval-groups {groups}: {plan.eval_tasks} holds {len(pool)} tasks",
                             hint=f"use --eval-groups {len(pool)} or fewer, or add tasks")
        tasks = pool[:groups]
    elif options.play.env is None:
        raise InputError("--eval-every with --agent or --agent-cmd needs --eval-tasks FILE: an agent's tasks come "
                         "from files", hint="write the held-out tasks to a JSONL file and pass --eval-tasks FILE")
    else:
        try:
            tasks = eval_tasks(factory, plan.eval_groups or plan.DEFAULT_GROUPS, options.plan.seed)
        except InputError as exc:
            raise InputError(f"--eval-every: {exc.message}", hint="give --eval-tasks FILE") from None
    by_construction = plan.eval_tasks is None and options.play.tasks is None and rule_of(factory) is not None \
        and options.plan.hold_out
    if not (by_construction or plan.allow_overlap):
        trained = [t for k in range(options.plan.steps) for t in training(k)] if options.play.tasks is None \
            else load_tasks(options.play.tasks)
        equal = overlap(trained, tasks)
        if equal:
            raise InputError(f"{len(equal)} of the {len(tasks)} evaluation tasks equal tasks the run trains on "
                             f"(the first: evaluation task {equal[0]}): they are not held out",
                             hint="give --eval-tasks a file of other tasks, or pass --allow-overlap to evaluate on "
                                  "them anyway")
    return tasks
