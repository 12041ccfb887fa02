"""`verbatim train`'s loop on the real engine: weights really arrive, versions are the samplers'.

Two short real runs on the session's engine (the default model, fp32):

- synchronous (``max_lag=0``, ``keep+salt``), 2 steps with a large learning rate: the engine's
  sampler logprobs after the push equal the trained model's (and differ from the base model's, so
  a skipped push fails); π − μ on a step's own rollouts, before its optimizer step, is at the fp32
  agreement level; the run directory is an ordinary run (lint, every rollout's step);
- overlapping (``max_lag=1``, ``flush``), 3 steps: each token's recorded version is the one whose
  weights give its sampler logprob, checked against every checkpoint's weights.

Both evaluate on held-out tasks (``--eval-every``: every step, and every second step beside the next step's
rollouts): each evaluation is of the version just pushed, every one of its tokens, and an ordinary trace.

Each run goes through ``verbatim train``'s entry point, given the session's engine (which the run begins with
the base weights as version 0, and the next test's fixture again).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from verbatim.datamodel import Source
from verbatim.engine.protocol import CachePolicy, Sampling
from verbatim.harness.store import read_run
from verbatim.jobs.config import TrainConfig
from verbatim.jobs.train import run_training
from verbatim.rl.plan import TrainPlan
from verbatim.rl.rerendered import never_sampled, reply_ids, rerendered
from verbatim.rl.train import TrainLoop
from verbatim.rl.train_step import step_input
from verbatim.trainer.checkpoint import load_checkpoint
from verbatim.trainer.learner_config import LearnerConfig
from verbatim.trainer.reference import load_model, reference_logprobs

pytestmark = [pytest.mark.engine, pytest.mark.slow]

AGREEMENT = 1e-3  # fp32 engine vs transformers, max |Δ logprob| (docs/engine.md measures ≈ 4e-5)


def train(engine_runner, out: Path, plan: TrainPlan, learner: LearnerConfig, *, temperature: float = 1.0,
          env: str = "guess", env_args: dict | None = None, eval_every: int | None = None,
          ) -> tuple[TrainLoop, list[dict], int]:
    """``verbatim train``'s run (its entry point, given the session's engine, which it begins with the base
    weights as version 0): the loop, its metrics, and the version it started from. ``eval_every``: evaluate on
    2 held-out tasks, 2 samples each."""
    play = {"env": env, "env_args": {"high": 8, "max_guesses": 3} if env_args is None else env_args, "max_turns": 2}
    evaluation = {"eval_every": eval_every, "eval_groups": 2, "eval_samples": 2}
    config = TrainConfig(play=play, sampling={"max_tokens": 12, "temperature": temperature},
                         engine={"max_model_len": 2048}, output={"out": str(out)}, plan=plan, learner=learner,
                         evaluation=evaluation)
    ended: list[TrainLoop] = []
    history = run_training(config, engine=engine_runner.engine, on_end=ended.append)
    return ended[0], history, 0


@pytest.fixture(scope="module")
def synchronous(session_engine, tmp_path_factory):
    folder = tmp_path_factory.mktemp("train")
    plan = TrainPlan(steps=2, groups=2, group_size=2, max_lag=0, keep_checkpoints=2, checkpoint_every=1, seed=1)
    yield train(session_engine, folder / "sync", plan, LearnerConfig(lr=3e-4), eval_every=1)
    shutil.rmtree(folder, ignore_errors=True)  # 1.6 GB of checkpoints: CI's disk is not ours to fill


def test_a_synchronous_step_trains_on_its_own_policy(synchronous):
    """π − μ before the optimizer step is engine/trainer agreement, nothing more, at every step."""
    loop, lines, _ = synchronous
    assert [r["step"] for r in lines] == [0, 1, 2]  # steps count from 1, as the console and the checkpoints do;
    history = lines[1:]  # step 0's line is the evaluation before the first step
    # the learner's weights lived in the engine's shared buffer (one storage), set up before the first step
    assert len({p.untyped_storage().data_ptr() for p in loop.learner.model.parameters()}) == 1
    assert loop.share_s > 0
    for record in history:
        assert record["mismatch_mean_abs"] < 1e-4, record["mismatch_mean_abs"]
        quantiles = record["ratio_quantiles"]
        assert abs(quantiles["p01"] - 1) < AGREEMENT and abs(quantiles["p99"] - 1) < AGREEMENT
        assert record["dropped"]["any"] == 0.0
        assert set(record["policy_lag"]) == {"0"}
        assert 0 < record["entropy"] < math.log(loop.learner.vocab_size)  # π_old's, nats per model token


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_a_synchronous_step_at_another_temperature_trains_on_the_distribution_it_sampled(
        engine_runner, default_model_dir, tmp_path, temperature):
    """μ is the engine's processed logprob (after the temperature) and π is log_softmax(logits / T) with T read
    from the trace: they agree to fp32 as at T = 1. Raw logprobs, or π at T = 1, are off by ~0.1 a token."""
    plan = TrainPlan(steps=1, groups=1, group_size=2, max_lag=0, seed=3)
    loop, history, _ = train(engine_runner, tmp_path / "t", plan, LearnerConfig(lr=1e-5), temperature=temperature)
    record = history[0]
    assert record["temperature"] == temperature and record["model_tokens"] > 0
    assert record["mismatch_mean_abs"] < 1e-4, record["mismatch_mean_abs"]
    rollouts = read_run(loop.out).rollouts
    assert {t.sampling.temperature for r in rollouts for t in r.turns} == {temperature}
    tokens = rollouts[0].tokens
    at = np.flatnonzero(tokens.source == Source.MODEL)
    with torch.no_grad():  # the base weights sampled step 0: at T = 1 π is far from the recorded μ
        plain = reference_logprobs(load_model(default_model_dir), tokens.token_id, at).numpy()
    assert np.abs(plain - tokens.logprob[at]).mean() > 100 * AGREEMENT


def test_pushed_weights_are_what_the_engine_samples_with(engine_runner, default_model_dir, default_tokenizer,
                                                         synchronous, tmp_path):
    """Push the trained weights again; the engine's logprobs are the trained model's, not the base's."""
    loop, _, _ = synchronous
    engine = engine_runner.engine
    take_a_step_that_moves(loop)  # the run's own steps may all have had zero advantage (equal rewards)
    prompt = default_tokenizer.apply_chat_template([{"role": "user", "content": "Guess a number from 1 to 8."}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    trained = loop.learner.model.eval()
    engine_runner.run(engine.update_weights(loop.learner.engine_weights(), engine.version + 1, CachePolicy.FLUSH))
    try:
        got = engine_runner.run(engine.generate(prompt, Sampling(max_tokens=16, temperature=1.0, seed=3)))
    finally:
        engine_runner.run(engine.update_weights(default_model_dir, engine.version + 1, CachePolicy.FLUSH))
    ids = list(prompt) + got.token_ids.tolist()
    at = range(len(prompt), len(ids))
    with torch.no_grad():
        want = reference_logprobs(trained, ids, at).numpy()
        base = reference_logprobs(load_model(default_model_dir), ids, at).numpy()
    assert np.abs(want - got.logprobs).max() < AGREEMENT
    assert np.abs(base - got.logprobs).max() > 10 * AGREEMENT, "training did not move the logprobs: no proof"


def take_a_step_that_moves(loop: TrainLoop) -> None:
    """One more learner step on the run's last rollouts with advantages +1/−1, so the weights surely move. Their
    tokens are recorded as sampled by the learner's own version: the run's version-lag mask (--max-lag 0) would
    drop tokens of the versions before it."""
    from verbatim.datamodel import TokenColumns
    from verbatim.trainer.step_input import StepInput

    rollouts = sorted(read_run(loop.out).rollouts, key=lambda r: r.rollout_id)[-2:]
    columns = [TokenColumns(token_id=t.token_id, source=t.source, logprob=t.logprob, turn=t.turn,
                            policy_version=np.where(t.policy_version >= 0, loop.learner.version, -1))
               for t in (r.tokens for r in rollouts)]
    loop.learner.train_step(StepInput(columns=columns, advantages=np.array([1.0, -1.0]), groups=[[0, 1]]))


def test_the_training_run_is_an_ordinary_run_directory(synchronous):
    loop, history, start = synchronous
    rollouts = read_run(loop.out).rollouts
    assert sorted({r.info["step"] for r in rollouts}) == [1, 2]
    assert len({r.rollout_id for r in rollouts}) == len(rollouts) == 2 * 2 * 2
    assert all(r.rollout_id.startswith(f"s{r.info['step']:04d}-") for r in rollouts)
    lines = [json.loads(x) for x in (loop.out / "metrics.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines] == [start, start + 1, start + 2] == [r["version"] for r in history]
    assert sorted(p.name for p in (loop.out / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    from typer.testing import CliRunner

    from verbatim.cli.app import app

    result = CliRunner().invoke(app, ["lint", "trace", str(loop.out)])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def overlapping(session_engine, tmp_path_factory):
    folder = tmp_path_factory.mktemp("train")
    plan = TrainPlan(steps=3, groups=2, group_size=2, max_lag=1, cache_policy=CachePolicy.FLUSH,
                     keep_checkpoints=3, checkpoint_every=1, seed=2)  # every version's weights kept
    yield train(session_engine, folder / "lag1", plan, LearnerConfig(lr=3e-4), eval_every=2)
    shutil.rmtree(folder, ignore_errors=True)


def test_each_token_records_the_version_that_sampled_it(overlapping, default_model_dir):
    """Under flush every token's logprob is its version's weights' on its full context (no hybrid KV)."""
    loop, history, start = overlapping
    rollouts = read_run(loop.out).rollouts
    models = {start: load_model(default_model_dir)}
    for folder in sorted((loop.out / "checkpoints").iterdir()):
        model = load_model(default_model_dir)
        state = load_checkpoint(folder, model, None)
        models[int(state["version"])] = model.eval()
    seen: set[tuple[int, int]] = set()
    for rollout in rollouts:
        step, tokens = rollout.info["step"], rollout.tokens
        model_rows = np.flatnonzero(tokens.source == Source.MODEL)
        versions = tokens.policy_version[model_rows]
        assert versions.min() >= start + max(step - 2, 0) and versions.max() <= start + step - 1  # lag <= 1
        for version in np.unique(versions):
            at = model_rows[versions == version]
            with torch.no_grad():
                pi = reference_logprobs(models[int(version)], tokens.token_id, at).numpy()
            assert np.abs(pi - tokens.logprob[at]).max() < AGREEMENT, (rollout.rollout_id, int(version))
            seen.add((step, int(version)))
    assert (2, start) in seen, "step 2 never played while step 1 trained: no overlap was tested"
    assert all(set(r["policy_lag"]) <= {"0", "1"} for r in history if r["step"] > 0)


def evaluations_are_of_the_version_just_pushed(loop: TrainLoop, history: list[dict], steps: list[int]) -> None:
    """Each evaluation's line, folder and tokens name the version after its step, its figures are its trace's, it
    lints clean, and none of its rollouts reached the training trace."""
    from typer.testing import CliRunner

    from verbatim.cli.app import app
    from verbatim.harness.evaluation import folder_figures

    evaluated = {r["step"]: r["eval"] for r in history if "eval" in r}
    assert sorted(evaluated) == steps and all(evaluated[n]["version"] == n for n in steps)
    trained = {r.rollout_id for r in read_run(loop.out).rollouts}
    for step in steps:
        folder = loop.out / "eval" / f"step-{step:06d}"
        rollouts = read_run(folder).rollouts
        assert len(rollouts) == 2 * 2 and not trained & {r.rollout_id for r in rollouts}
        sampled = np.concatenate([r.tokens.policy_version[r.tokens.source == Source.MODEL] for r in rollouts])
        assert sampled.size and set(sampled.tolist()) == {step}
        assert folder_figures(folder, version=step) | {"wall_s": evaluated[step]["wall_s"]} == evaluated[step]
        assert sorted(r.task["id"] for r in rollouts if r.rollout_id.endswith("-r00")) == ["eval-0", "eval-1"]
        lint = CliRunner().invoke(app, ["lint", "trace", str(folder)])
        assert lint.exit_code == 0, lint.output[-2000:]
    assert sorted(p.name for p in (loop.out / "eval").iterdir()) == [f"step-{n:06d}" for n in steps]


def test_evaluations_before_the_first_step_and_after_each_are_of_the_weights_just_pushed(synchronous):
    loop, history, _ = synchronous
    evaluations_are_of_the_version_just_pushed(loop, history, [0, 1, 2])
    assert set(history[0]) == {"step", "version", "eval"}  # step 0: the evaluation's line of its own


def test_under_max_lag_an_evaluation_holds_its_version_while_the_next_step_plays(overlapping):
    """--max-lag 1 --eval-every 2 over 3 steps: evaluated after steps 0, 2 and 3, each of one version though the
    next step's rollouts play beside it."""
    loop, history, _ = overlapping
    evaluations_are_of_the_version_just_pushed(loop, history, [0, 2, 3])


def test_a_trainer_fed_re_rendered_contexts_trains_tokens_the_model_never_sampled(engine_runner, default_model_dir,
                                                                                  tmp_path):
    """The bench's ablation path on a real step: replies cut by max tokens re-render with an end token."""
    from verbatim.trainer.logprob_files import read_logprobs, step_file

    plan = TrainPlan(steps=1, groups=2, group_size=2, max_lag=0, seed=1, context="rerendered")
    loop, history, start = train(engine_runner, tmp_path / "rerendered", plan, LearnerConfig(lr=1e-5))
    record = history[0]
    rollouts = read_run(loop.out).rollouts
    trained = set(step_input(rollouts, plan.advantage)[0].rollout_ids)
    cut = [(r, k) for r in rollouts if r.rollout_id in trained for k, t in enumerate(r.turns)
           if t.finish_reason == "length"]
    assert cut, "no trained reply was cut: nothing for the re-render to change"
    assert record["version"] == start + 1 and record["rerendered_failed"] == 0 and record["rerendered_changed"] > 0
    stops = set(loop.renderer.stop_token_ids)
    for rollout, k in cut:  # the model stopped at max tokens; the template closes the reply anyway
        again = rerendered(rollout, loop.renderer)
        assert reply_ids(rollout.tokens, k)[-1] not in stops and reply_ids(again, k)[-1] in stops
    assert record["rerendered_never_sampled"] == sum(
        never_sampled(r, rerendered(r, loop.renderer)) for r in rollouts if r.rollout_id in trained)
    assert record["mismatch_mean_abs"] == 0.0  # π_old stands in for the missing μ
    assert step_file(loop.out, 1).is_file()
    assert read_logprobs(step_file(loop.out, 1)) == {}  # its rows are not the trace's


class TrainedFirstFactory:
    """Two turns a rollout; from step 2 on, a rollout's second request waits until the step before has been
    trained (its logprob file, written before the push) and a moment more: an update that is not held back
    lands between a rollout's two requests."""

    name = "trained-first"

    def __init__(self, out: str, plan_seed: int) -> None:
        self.out, self.plan_seed = Path(out), plan_seed

    def make(self):
        return TrainedFirstEnv(self.out)

    def tasks(self, count: int, seed: int) -> list[dict]:
        step = seed - TrainPlan(seed=self.plan_seed).task_seed(0) + 1  # step k + 1's tasks: task_seed(k)
        return [{"id": f"t{seed}-{i}", "n": seed + i, "step": step} for i in range(count)]


class TrainedFirstEnv:
    def __init__(self, out: Path) -> None:
        self.out, self.step_number, self.turns = out, 1, 0

    def reset(self, task, seed):
        from verbatim.datamodel import Message
        from verbatim.envs.base import Reset

        self.step_number = task["step"]
        return Reset(messages=(Message(role="user", content=f"Say something about the number {task['n']}."),))

    def step(self, message):
        import time

        from verbatim.datamodel import Message
        from verbatim.envs.base import StepResult

        self.turns += 1
        if self.turns == 1 and self.step_number > 1:
            trained = self.out / "trainer_logprobs" / f"step-{self.step_number - 1:06d}.parquet"
            deadline = time.monotonic() + 300
            while not trained.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(2.0)  # an eager push (well under a second here) lands meanwhile
        return StepResult(messages=(Message(role="user", content="And then?"),),
                          reward=(len(message.content) % 11) / 10, done=self.turns == 2)


def test_a_fixed_lag_samples_every_step_with_the_weights_exactly_max_lag_behind(engine_runner, default_model_dir,
                                                                                tmp_path):
    """``--max-lag 1 --fixed-lag``: step n's every token has version n − 2 (step 1's and 2's the start's), though
    each step's second requests wait until the step before is trained (without the fixed lag they would take
    its weights: the test fails so)."""
    plan = TrainPlan(steps=3, groups=1, group_size=2, max_lag=1, fixed_lag=True, keep_checkpoints=1, seed=4)
    loop, history, start = train(engine_runner, tmp_path / "fixed", plan, LearnerConfig(lr=3e-4),
                                 env="test_train_engine:TrainedFirstFactory",
                                 env_args={"out": str(tmp_path / "fixed"), "plan_seed": plan.seed})
    assert [r["version"] for r in history] == [start + 1, start + 2, start + 3]
    for rollout in read_run(loop.out).rollouts:
        step, tokens = rollout.info["step"], rollout.tokens
        versions = set(tokens.policy_version[tokens.source == Source.MODEL].tolist())
        assert len(rollout.turns) == 2 and versions == {start + max(step - 2, 0)}, (rollout.rollout_id, versions)
    assert all(r["hybrid_tokens"] == 0 for r in history)
