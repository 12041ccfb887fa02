"""Bring your own agent on the real engine: `verbatim run --agent` and `verbatim train --agent`.

The agents are written against clients nobody here wrote: the official ``openai`` package (async, a
three-request tool loop, streamed requests) and the OpenAI Agents SDK running its own loop over chat
completions (tests/agent_modes.py), and the example in examples/ (the sync ``openai.OpenAI`` client). One
run plays every mode on the session's in-process engine (through the CLI's own function, its printing
included); what each agent was told (usage, cached tokens) is held against what the trace recorded, later
requests must hit the prefix cache, and an agent that drops its oldest exchange leaves a second segment that
lint, the summary and the trainer's export all see.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from subprocess_cli import cli
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.cli.run import run_command
from verbatim.datamodel import Source
from verbatim.harness.store import read_manifest, read_run
from verbatim.jobs.config import RunOptions, TrainConfig
from verbatim.jobs.train import run_training
from verbatim.rl.plan import TrainPlan
from verbatim.trainer.learner_config import LearnerConfig

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
TASKS = [{"mode": "tools", "question": "What is 17 + 25? Use the add tool.", "answer": 42},
         {"mode": "stream", "question": "Name three colours."},
         {"mode": "framework", "question": "What is 2 + 3?", "answer": 5},
         {"mode": "rewrite", "question": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory, session_engine) -> Path:
    """``verbatim run --agent …`` as the CLI runs it (its printing included), given the session's engine."""
    folder = tmp_path_factory.mktemp("agents")
    tasks = folder / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    out = folder / "run"
    printed = io.StringIO()
    options = RunOptions(play={"agent": str(ROOT / "tests" / "agent_modes.py") + ":play", "tasks": str(tasks),
                               "max_turns": 4}, sampling={"max_tokens": 24}, engine={"max_model_len": 2048},
                         output={"out": str(out)}, group_size=2)
    run_command(options, Console(file=printed, width=200), str(folder / "summary.json"),
                engine=session_engine.engine)
    (folder / "stdout.txt").write_text(printed.getvalue())
    return out


def by_mode(run: Path) -> dict[str, list]:
    found: dict[str, list] = {}
    for rollout in read_run(run).rollouts:
        found.setdefault(rollout.task["mode"], []).append(rollout)
    return found


def test_every_agent_mode_played_and_said_what_it_was_told(agent_run):
    modes = by_mode(agent_run)
    assert sorted(modes) == ["framework", "rewrite", "stream", "tools"] and all(len(v) == 2 for v in modes.values())
    for rollouts in modes.values():
        for rollout in rollouts:
            assert rollout.status == "ok", (rollout.rollout_id, rollout.error)
            assert rollout.info["agent"]["requests"] == len(rollout.turns)
    for rollout in modes["tools"] + modes["stream"]:
        told = rollout.info["env"]
        for turn in rollout.turns:  # the usage each request returned is the engine's own account
            assert told[f"cached_{turn.index}"] == turn.cached_tokens
        for turn in rollout.turns[1:]:  # each later request extended the last and found it cached
            assert turn.cached_tokens >= rollout.turns[turn.index - 1].prompt_end - 16, turn
    for rollout in modes["tools"]:
        assert len(rollout.turns) == 3 and rollout.info["tools"][0]["function"]["name"] == "add"
        assert [rollout.info["env"][f"prompt_{k}"] for k in range(3)] == [t.prompt_tokens for t in rollout.turns]
    for rollout in modes["framework"]:
        assert rollout.info["env"]["solved"] is False and rollout.info["tools"][0]["function"]["name"] == "add"


def test_sampling_fields_an_agent_sets_are_ignored_counted_and_reported_once(agent_run):
    summary = json.loads((agent_run.parent / "summary.json").read_text())
    assert summary["ignored_request_fields"] == {"temperature": 4}  # 2 streamed rollouts × 2 requests
    stdout = " ".join((agent_run.parent / "stdout.txt").read_text().split())
    assert stdout.count("warning: the agent's requests set temperature (4×)") == 1
    for rollout in by_mode(agent_run)["stream"]:
        assert {t.sampling.temperature for t in rollout.turns} == {1.0}  # μ is the run's distribution


def test_the_sampled_tokens_are_kept_as_sampled_with_their_logprobs(agent_run):
    manifest = read_manifest(agent_run)
    assert manifest.status == "completed" and manifest.config["options"]["play"]["agent"].endswith(
        "agent_modes.py:play")
    for rollout in read_run(agent_run).rollouts:
        model = rollout.tokens.source == Source.MODEL
        assert model.any() and (rollout.tokens.logprob[model] <= 0).all()
        assert set(rollout.tokens.policy_version[model].tolist()) == {0}


def test_a_rewritten_history_is_a_second_segment_that_every_reader_sees(agent_run, tmp_path):
    for rollout in by_mode(agent_run)["rewrite"]:
        (brk,) = rollout.info["segments"]
        assert (brk["message"], brk["role"], brk["field"]) == (0, "user", "dropped") and brk["turn"] == 2
        first, second = rollout.segments()
        assert len(first.turns) == 2 and len(second.turns) == 1
        assert rollout.info["env"]["last_prompt"] == second.turns[0].prompt_tokens
        shown = cli("show", str(agent_run), rollout.rollout_id)
        assert shown.returncode == 0, shown.stderr
        assert "══ history break before turn 2: the agent rewrote its history (messages 0-1 (user, assistant) were " \
            "dropped); a new segment starts here" in " ".join(shown.stdout.split()), shown.stdout
    summary = json.loads((agent_run.parent / "summary.json").read_text())
    assert summary["history_breaks"] == 2 and summary["broken_rollouts"] == 2
    lint = cli("lint", "trace", str(agent_run), "--json")
    verdicts = [json.loads(line) for line in lint.stdout.splitlines() if line.strip()]
    problems = [p for v in verdicts for p in v.get("problems", ())]
    assert lint.returncode == 1 and {p["kind"] for p in problems} == {"history_break"}, problems
    assert all("messages 0-1 (user, assistant) were dropped" in p["detail"] and "prefilled" in p["detail"]
               for p in problems)
    export = cli("export", str(agent_run), "--format", "verl", "--out", str(tmp_path / "verl.parquet"))
    assert export.returncode == 0, export.stdout + export.stderr
    import pyarrow.parquet as pq

    ids = pq.read_table(tmp_path / "verl.parquet").column("rollout_id").to_pylist()
    assert sum(i.endswith("#1") for i in ids) == 2 and len(ids) == 10


def test_train_runs_the_example_agent_for_real_steps(tmp_path, engine_runner):
    out = tmp_path / "train"
    config = TrainConfig(play={"agent": str(ROOT / "examples" / "calculator_agent.py") + ":solve",
                               "tasks": str(ROOT / "examples" / "calculator_tasks.jsonl"), "max_turns": 3},
                         sampling={"max_tokens": 24}, engine={"max_model_len": 2048}, output={"out": str(out)},
                         plan=TrainPlan(steps=2, groups=2, group_size=2),
                         learner=LearnerConfig(lr=1e-5))
    run_training(config, engine=engine_runner.engine)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and [x["version"] for x in lines] == [1, 2]
    assert read_manifest(out).status == "completed"
    for rollout in read_run(out).rollouts:
        assert rollout.status in ("ok", "truncated"), rollout.error
        model = rollout.tokens.source == Source.MODEL
        assert set(rollout.tokens.policy_version[model].tolist()) == {rollout.info["step"] - 1}
    lint = cli("lint", "trace", str(out))
    assert lint.returncode == 0, lint.stdout + lint.stderr


FAILING_AGENTS = '''
def raising(task, client):
    client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}])
    return {}["missing"]


def greedy(task, client):
    history = [{"role": "user", "content": "Count."}]
    for _ in range(3):
        reply = client.chat.completions.create(model="smol", messages=history)
        history += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
    return 1.0


def silent(task, client):
    return 1.0


def play(task, client):
    return {"raising": raising, "greedy": greedy, "silent": silent}[task["mode"]](task, client)
'''


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory, session_engine) -> tuple[Path, str, dict]:
    """One ``verbatim run`` (its own function, its printing included) of three agents, two rollouts each: one
    that raises, one that asks for a third turn under --max-turns 2 (and raises on the refusal), one that returns
    1.0 without calling the model."""
    folder = tmp_path_factory.mktemp("failing")
    (folder / "agents.py").write_text(FAILING_AGENTS)
    (folder / "tasks.jsonl").write_text("".join(json.dumps({"mode": m}) + "\n" for m in ("raising", "greedy",
                                                                                        "silent")))
    printed = io.StringIO()
    options = RunOptions(play={"agent": f"{folder / 'agents.py'}:play", "tasks": str(folder / "tasks.jsonl"),
                               "max_turns": 2}, sampling={"max_tokens": 8}, engine={"max_model_len": 2048},
                         output={"out": str(folder / "run")}, group_size=2)
    run_command(options, Console(file=printed, width=400), str(folder / "summary.json"), engine=session_engine.engine)
    lint = CliRunner().invoke(app, ["lint", "trace", str(folder / "run"), "--json"])
    findings = {}
    for line in lint.stdout.splitlines()[:-1]:
        verdict = json.loads(line)
        findings[verdict["rollout_id"]] = [f["kind"] for f in verdict["findings"]]
    return folder / "run", " ".join(printed.getvalue().split()), {"exit": lint.exit_code, "findings": findings,
                                                                  "run": json.loads(lint.stdout.splitlines()[-1])}


def _of(out: Path, mode: str) -> list:
    return [r for r in read_run(out).rollouts if r.task["mode"] == mode]


def test_a_failed_rollout_keeps_the_agents_traceback_has_no_reward_and_is_said_in_one_line(failing_run):
    out, printed, lint = failing_run
    rollouts = _of(out, "raising")
    assert [r.status for r in rollouts] == ["error", "error"] and {r.reward for r in rollouts} == {None}
    for rollout in rollouts:
        assert rollout.error.startswith("the agent raised KeyError")
        trace = rollout.info["agent"]["traceback"]
        assert trace.startswith("Traceback (most recent call last)") and 'return {}["missing"]' in trace
        assert lint["findings"][rollout.rollout_id] == ["failed"]
    assert "warning: 4 of 6 rollouts failed (4 error: no reward), first: the agent" in printed
    summary = json.loads((out.parent / "summary.json").read_text())
    assert summary["mean_reward"] is None and summary["rewards_left_out"] == 6
    assert lint["exit"] == 1 and lint["run"]["errors"] == 4


def test_rollouts_cut_at_max_turns_are_counted_and_listed_by_lint(failing_run):
    out, printed, lint = failing_run
    rollouts = _of(out, "greedy")
    assert [r.status for r in rollouts] == ["truncated", "truncated"] and {r.reward for r in rollouts} == {None}
    assert all(r.error.startswith("max turns (2) reached: the agent asked for more; then the agent raised")
               for r in rollouts)
    assert "2 of 6 were cut at --max-turns" in printed
    assert json.loads((out.parent / "summary.json").read_text())["cut_at_max_turns"] == 2
    assert all(lint["findings"][r.rollout_id] == ["truncated"] for r in rollouts)
    assert lint["run"]["truncated"] == 2 and lint["run"]["truncated_without_reward"] == 2


def test_an_agent_that_never_asks_the_model_fails_and_its_reward_is_counted_nowhere(failing_run):
    out, _, lint = failing_run
    rollouts = _of(out, "silent")
    assert [r.status for r in rollouts] == ["error", "error"] and {r.reward for r in rollouts} == {None}
    assert {r.info["agent"]["returned_reward"] for r in rollouts} == {1.0}
    assert all(lint["findings"][r.rollout_id] == ["failed"] for r in rollouts)
    assert json.loads((out.parent / "summary.json").read_text())["statuses"] == {"error": 4, "truncated": 2}


def test_eval_plays_an_agent_as_run_does(engine_runner, tmp_path):
    """``verbatim eval --agent … --tasks …``: K samples a task, a rewritten history a second segment as in ``run``,
    and what the agent says of ``solved`` is what pass@k counts (a task whose agent never says: avg@K only)."""
    from verbatim.cli.evaluate import eval_command
    from verbatim.jobs.config import EvalOptions

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS if t["mode"] in ("framework", "rewrite")))
    out = tmp_path / "eval"
    options = EvalOptions(play={"agent": str(ROOT / "tests" / "agent_modes.py") + ":play", "tasks": str(tasks),
                                "max_turns": 4}, sampling={"max_tokens": 24}, engine={"max_model_len": 2048},
                          output={"out": str(out)}, group_size=2)
    found = eval_command(options, Console(file=io.StringIO(), width=200), engine=engine_runner.engine)
    assert (found["tasks"], found["samples"]) == (2, 2)
    framework, rewrite = found["per_task"]
    assert framework["pass_at_k"] == {"1": 0.0, "2": 0.0} and rewrite["pass_at_k"] is None
    assert found["pass_at_k"] == {"1": 0.0, "2": 0.0}  # over the tasks whose agent said
    assert rewrite["mean_reward"] == 0.5
    for rollout in by_mode(out)["rewrite"]:
        first, second = rollout.segments()
        assert len(first.turns) == 2 and len(second.turns) == 1
