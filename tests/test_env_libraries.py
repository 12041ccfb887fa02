"""Environments from the libraries users have: skyrl-gym's text envs and TextArena's single-player games.

On the real engine (the session's): skyrl-gym's ``gsm8k_multi_turn`` on a small local task file and two
TextArena games are played end to end; the trace lints clean and every reward is the library's own, checked
by replaying the recorded replies through the library itself. Without an engine: what is refused, and why.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from verbatim.datamodel import Message
from verbatim.engine.protocol import Sampling
from verbatim.envs.registry import load_env
from verbatim.errors import InputError
from verbatim.harness.rollout import LoopConfig
from verbatim.harness.run import Run, RunPlan
from verbatim.harness.store import RunManifest, read_run
from verbatim.lint.trace import lint_run
from verbatim.renderers.registry import get_renderer

GSM8K_TASKS = [
    {"prompt": [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have? "
                                            "End with '#### ANSWER'."}],
     "reward_spec": {"method": "rule", "ground_truth": "7"}, "extra_info": {"max_turns": 2}},
    {"prompt": [{"role": "user", "content": "A box holds 6 eggs. How many eggs are in 2 boxes? "
                                            "End with '#### ANSWER'."}],
     "reward_spec": {"method": "rule", "ground_truth": "12"}, "extra_info": {"max_turns": 2}},
]


@pytest.fixture(scope="module")
def renderer(default_model_dir):
    return get_renderer("smollm2", model_dir=default_model_dir)


def play(engine_runner, renderer, factory, tasks, out: Path, *, max_turns: int):
    engine = engine_runner.engine
    plan = RunPlan(run_id=out.name, groups=len(tasks), group_size=2, seed=3)
    loop = LoopConfig(max_turns=max_turns, context_budget=engine.config.max_model_len,
                      sampling=Sampling(max_tokens=24, temperature=1.0), step_timeout_s=60)
    manifest = RunManifest(run_id=out.name, model="smollm2-135m-instruct", renderer="smollm2",
                           engine={"kind": "inproc", "block_size": engine.block_size, "cache_policy": "keep"},
                           config={"plan": plan.model_dump(exclude={"run_id"})})
    run = Run(plan, loop, engine, renderer, factory, tasks, out, manifest)
    engine_runner.run(run.play(), timeout=900)
    report = lint_run(out)
    assert report.ok and report.run.complete, [v.as_json() for v in report.verdicts if not v.ok]
    return read_run(out).rollouts


def replies(rollout) -> list[Message]:
    return [Message.model_validate(m) for m in rollout.info["messages"] if m["role"] == "assistant"]


@pytest.mark.engine
def test_skyrl_gsm8k_multi_turn_plays_with_the_librarys_own_rewards(engine_runner, renderer, tmp_path):
    factory = load_env("skyrl:gsm8k_multi_turn")
    rollouts = play(engine_runner, renderer, factory, GSM8K_TASKS, tmp_path / "gsm8k", max_turns=3)
    assert len(rollouts) == 4 and {r.status for r in rollouts} == {"ok"}  # the env ended each episode
    from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv

    for rollout in rollouts:
        env = GSM8kMultiTurnEnv(extras={**rollout.task})
        env.init(rollout.task["prompt"])
        said = [env.step(m.content) for m in replies(rollout)]
        assert [t.reward for t in rollout.turns] == [s["reward"] for s in said]  # per turn, unchanged
        assert rollout.reward == pytest.approx(sum(s["reward"] for s in said)) and said[-1]["done"]
        assert rollout.info["env"]["metrics"] == {"steps": len(said)}


@pytest.mark.engine
@pytest.mark.parametrize("game,options", [("GuessTheNumber-v0", {"max_turns": 2}),
                                          ("TowerOfHanoi-v0", {"max_turns": 2})])
def test_a_textarena_game_plays_to_its_end_with_the_games_reward(engine_runner, renderer, tmp_path, game, options):
    factory = load_env(f"textarena:{game}", **options)
    tasks = [{"seed": 11}]
    rollouts = play(engine_runner, renderer, factory, tasks, tmp_path / game, max_turns=4)
    assert {r.status for r in rollouts} == {"ok"} and len(rollouts) == 2
    for rollout in rollouts:
        said = replay_textarena(factory, 11, replies(rollout))
        assert said["done"] and rollout.reward == said["reward"] and rollout.info["env"]["game"] == said["info"]
        prompts = [m["content"] for m in rollout.info["messages"] if m["role"] == "user"]
        for reply, following in zip(replies(rollout), prompts[1:]):
            if reply.content.strip():
                assert not following.startswith(reply.content)  # the echo of the model's own move is left out


def replay_textarena(factory, seed: int, moves: list[Message]) -> dict:
    """The same game, seeded the same, through TextArena's own API with the recorded moves."""
    import random

    import textarena

    state = random.getstate()
    try:
        game = textarena.make(factory.raw, **factory.options)
        game.reset(num_players=1, seed=seed)
        for move in moves:
            done, _ = game.step(action=move.content)
        rewards, info = game.close()
    finally:
        random.setstate(state)
    from verbatim.envs.textarena_games import _plain

    return {"done": done, "reward": float(rewards[0]), "info": _plain(info)}


def test_concurrent_games_each_depend_on_their_seed_alone():
    factory = load_env("textarena:GuessTheNumber-v0", max_turns=6)

    def feedback(seed: int, out: list) -> None:
        game = factory.make()
        game.reset({"seed": seed}, 0)
        for guess in range(1, 7):
            result = game.step(Message(role="assistant", content=f"[{guess}]"))
            out.append((result.messages[0].content if result.messages else None, result.reward))

    alone = []
    feedback(5, alone)
    together = [[] for _ in range(6)]
    threads = [threading.Thread(target=feedback, args=(5 if k % 2 else 9, together[k])) for k in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(together[k] == alone for k in range(1, 6, 2))


@pytest.mark.parametrize("spec,words", [
    ("textarena:TicTacToe-v0", "does not start for one player"),
    ("textarena:TwentyQuestions-v0", "calls a language model itself ('OpenRouterAgent'"),
    ("textarena:Hangman-v0", "needs the network ('nltk.download'"),
    ("skyrl:search", "needs the network ('import requests' in skyrl_gym/tools/search.py)"),
    ("skyrl:nope", "skyrl-gym has no env 'nope'"),
    ("textarena:Nope-v0", "TextArena has no game 'Nope-v0'"),
])
def test_envs_that_cannot_be_played_faithfully_are_refused_with_the_reason(spec, words):
    with pytest.raises(InputError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_env(spec)


def test_a_skyrl_env_that_rewrites_the_reply_is_an_error():
    factory = load_env("skyrl:gsm8k")
    env = factory.make()
    env.reset({"prompt": [{"role": "user", "content": "1+1?"}], "reward_spec": {"ground_truth": "2"}}, 0)

    class Rewriting:
        def step(self, action):
            return {"observations": [], "reward": 1.0, "done": True, "metadata": {},
                    "postprocessed_action": action[:2]}

    env.env = Rewriting()
    from verbatim.errors import EnvError

    with pytest.raises(EnvError, match="rewrote the model's reply"):
        env.step(Message(role="assistant", content="#### 2"))
