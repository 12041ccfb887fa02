"""Held-out tasks (envs/held_out.py): the built-in envs' training and evaluation draws never share a task, whatever
the seed and however small the task space; an env without a rule gets eval tasks of seeds training never uses;
and a training run's evaluation tasks are refused before anything starts when they equal training tasks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verbatim.envs.held_out import EVAL_SEED_BASE, content_key, draw, eval_tasks, overlap, rule_of
from verbatim.envs.registry import load_env
from verbatim.errors import InputError
from verbatim.jobs.config import TrainConfig
from verbatim.jobs.evaluate import training_eval_tasks
from verbatim.rl.plan import EvalPlan, TrainPlan

BUILTINS = [("guess", {}), ("guess", {"high": 5, "max_guesses": 3}), ("tools", {}), ("python", {}),
            ("longdoc", {"words": 200})]


@pytest.mark.parametrize("name,args", BUILTINS)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_no_eval_task_of_a_builtin_env_equals_a_training_task_of_the_same_run(name, args, seed):
    factory = load_env(name, **args)
    plan = TrainPlan(seed=seed, groups=4, steps=6)
    trained = [t for k in range(plan.steps) for t in draw(factory, plan.groups, plan.task_seed(k), held_out=False)]
    evaluated = eval_tasks(factory, 8, seed)
    assert len(evaluated) == 8 and len(trained) == plan.steps * plan.groups
    assert overlap(trained, evaluated) == []
    assert all(rule_of(factory)(t) for t in evaluated) and not any(rule_of(factory)(t) for t in trained)
    assert [t["id"] for t in evaluated] == [f"eval-{i}" for i in range(8)]
    assert eval_tasks(factory, 8, seed) == evaluated  # a pure function of the seed


def test_guess_holds_out_one_target_in_five_and_a_range_too_small_is_one_line():
    small = load_env("guess", high=5)
    assert {t["target"] for t in eval_tasks(small, 20, 0)} == {3}
    assert {t["target"] for t in draw(small, 40, 7, held_out=False)} == {1, 2, 4, 5}
    wide = load_env("guess")
    assert {t["target"] for t in eval_tasks(wide, 200, 1)} == set(range(3, 51, 5))
    with pytest.raises(InputError, match="held-out part is too small"):
        eval_tasks(load_env("guess", high=2), 1, 0)


def test_a_rule_is_on_the_content_never_the_id():
    factory = load_env("tools")
    task = draw(factory, 1, 3, held_out=True)[0]
    assert rule_of(factory)({**task, "id": "another"}) and content_key({**task, "id": "x"}) == content_key(task)


class NoRule:
    """A user's factory: a generator, no held-out rule."""

    name = "norule"

    def make(self):
        raise NotImplementedError

    def tasks(self, count, seed):
        return [{"id": f"{seed}-{i}", "n": (seed + i) % 3} for i in range(count)]


def test_an_env_without_a_rule_draws_eval_tasks_from_seeds_training_never_uses():
    assert draw(NoRule(), 2, 5, held_out=False) == NoRule().tasks(2, 5)
    assert [t["n"] for t in eval_tasks(NoRule(), 2, 5)] == [(EVAL_SEED_BASE + 5 + i) % 3 for i in range(2)]


def _config(tmp_path, **evaluation) -> TrainConfig:
    return TrainConfig(play={"env": "guess"}, plan={"steps": 3, "groups": 2},
                       output={"out": str(tmp_path / "run")}, evaluation={"eval_every": 1, **evaluation})


def _training(config: TrainConfig, factory):
    plan = config.plan
    return lambda k: draw(factory, plan.groups, plan.task_seed(k), held_out=False)


def test_a_training_runs_eval_tasks_equal_to_its_training_tasks_are_refused_unless_allowed(tmp_path):
    factory = NoRule()  # three contents: eval tasks surely repeat training's
    config = _config(tmp_path).model_copy(update={"play": _config(tmp_path).play.model_copy(update={"env": "x"})})
    with pytest.raises(InputError, match="equal tasks the run trains on") as caught:
        training_eval_tasks(config, factory, _training(config, factory))
    assert "--allow-overlap" in caught.value.hint
    allowed = _config(tmp_path, allow_overlap=True)
    allowed = allowed.model_copy(update={"play": allowed.play.model_copy(update={"env": "x"})})
    assert len(training_eval_tasks(allowed, factory, _training(allowed, factory))) == EvalPlan.DEFAULT_GROUPS


def test_the_same_task_file_for_training_and_evaluation_is_refused_unless_allowed(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"target": 3}\n{"target": 7}\n')
    config = _config(tmp_path, eval_tasks=str(tasks))
    config = config.model_copy(update={"play": config.play.model_copy(update={"tasks": str(tasks)})})
    factory = load_env("guess")
    with pytest.raises(InputError, match="2 of the 2 evaluation tasks equal"):
        training_eval_tasks(config, factory, None)
    other = tmp_path / "other.jsonl"
    other.write_text('{"target": 9}\n')
    config = config.model_copy(update={"evaluation": config.evaluation.model_copy(update={"eval_tasks": str(other)})})
    assert training_eval_tasks(config, factory, None) == [{"target": 9}]


def test_no_evaluation_without_eval_every_and_an_agent_needs_a_file(tmp_path):
    plain = TrainConfig(play={"env": "guess"})
    assert training_eval_tasks(plain, load_env("guess"), None) is None
    agent = _config(tmp_path).model_copy(update={"play": _config(tmp_path).play.model_copy(
        update={"env": None, "agent": "a.py:f"})})
    with pytest.raises(InputError, match="needs --eval-tasks FILE"):
        training_eval_tasks(agent, None, None)


def test_an_env_that_makes_no_tasks_is_named_with_eval_every(tmp_path):
    class Plain:
        name = "plain"

        def reset(self, task, seed):
            raise NotImplementedError

        def step(self, message):
            raise NotImplementedError

    from verbatim.envs.registry import EnvClassFactory

    with pytest.raises(InputError, match="--eval-every: env 'plain' has no task generator") as caught:
        training_eval_tasks(_config(tmp_path), EnvClassFactory(Plain, {}), None)
    assert "--eval-tasks" in caught.value.hint


@pytest.mark.parametrize("every,steps,due", [(1, 2, [0, 1, 2]), (2, 5, [0, 2, 4, 5]), (3, 3, [0, 3]),
                                             (None, 4, [])])
def test_evaluations_are_due_before_the_first_step_every_n_and_after_the_last(every, steps, due):
    assert [s for s in range(steps + 1) if EvalPlan(eval_every=every).due(s, steps)] == due


def test_pass_k_above_the_samples_is_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="pass@8 needs 1 <= k <= the 4 samples"):
        EvalPlan(eval_every=1, eval_samples=4, eval_pass_k=(1, 8))
