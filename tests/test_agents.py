"""The agent endpoint's logic through the official ``openai`` client: extension, history breaks, errors.

The engine here is a scripted double (its replies are real SmolLM2 tokens of a given text), so every
protocol rule can be hit on purpose; tests/test_agents_engine.py plays agents on the real engine.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import numpy as np
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verbatim.agents import messages as chat
from verbatim.agents.loader import AgentCall, load_agent
from verbatim.agents.player import AgentPlayer
from verbatim.agents.result import read_result
from verbatim.datamodel import Completion, Source
from verbatim.errors import InputError
from verbatim.harness.rollout import LoopConfig, RolloutSpec
from verbatim.renderers.registry import get_renderer


@pytest.fixture(scope="module")
def renderer(default_model_dir):
    return get_renderer("smollm2", model_dir=default_model_dir)


class ScriptedEngine:
    """Answers each request with the next scripted text (real tokens + the stop token), version 0."""

    version = 0
    block_size = 16

    def __init__(self, renderer, replies=("Hello.",), delay_s: float = 0.0) -> None:
        self.renderer, self.replies, self.delay_s = renderer, list(replies), delay_s
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids, sampling=None, *, session_id=None, group_id=None, cache_salt=None):
        self.prompts.append([int(t) for t in prompt_ids])
        await asyncio.sleep(self.delay_s)
        text = self.replies[min(len(self.prompts) - 1, len(self.replies) - 1)]
        ids = self.renderer.encode(text) + [self.renderer.stop_token_ids[0]]
        cached = len(self.prompts[-2]) if len(self.prompts) > 1 else 0
        return Completion(token_ids=np.asarray(ids), logprobs=np.full(len(ids), -0.25),
                          versions=np.zeros(len(ids)), finish_reason="stop", prompt_tokens=len(prompt_ids),
                          cached_tokens=min(cached, len(prompt_ids)))


def play(renderer, agent, *, replies=("Hello.",), task=None, max_turns=4, budget=4096, timeout_s=30.0,
         delay_s=0.0, max_tokens=16):
    """One rollout of ``agent`` through a fresh endpoint; returns (rollout, engine)."""
    engine = ScriptedEngine(renderer, replies, delay_s)
    config = LoopConfig(max_turns=max_turns, context_budget=budget)
    config = config.model_copy(update={"sampling": config.sampling.model_copy(update={"max_tokens": max_tokens})})

    async def go():
        async with AgentPlayer(engine, renderer, config, model_name="smol", timeout_s=timeout_s) as player:
            spec = RolloutSpec(run_id="run", group_id="g0000", rollout_id="g0000-r00", task=task or {"q": "hi"},
                               seed=0)
            return await player.play(spec, AgentCall("test", agent))

    return asyncio.run(go()), engine


def user(text):
    return {"role": "user", "content": text}


# ---------------------------------------------------------------------------
# Token-exact by construction
# ---------------------------------------------------------------------------


def test_each_request_appends_only_its_new_messages_and_the_sampled_tokens(renderer):
    async def agent(task, client):
        history = [{"role": "system", "content": "Be brief."}, user(task["q"])]
        first = await client.chat.completions.create(model="smol", messages=history)
        history += [first.choices[0].message.model_dump(exclude_none=True), user("And then?")]
        second = await client.chat.completions.create(model="smol", messages=history)
        return {"reward": 0.5, "solved": second.choices[0].message.content == "Fine.",
                "metrics": {"cached": second.usage.prompt_tokens_details.cached_tokens}}

    rollout, engine = play(renderer, agent, replies=("Hello.", "Fine."))
    assert rollout.status == "ok" and rollout.reward == 0.5 and rollout.info["env"]["solved"] is True
    from verbatim.datamodel import Message

    opening = renderer.render([Message(role="system", content="Be brief."), Message(role="user", content="hi")],
                              add_generation_prompt=True).token_ids
    reply = renderer.encode("Hello.") + list(renderer.stop_token_ids[:1])
    bridge = renderer.bridge(list(opening) + reply, [Message(role="user", content="And then?")])
    expected = list(opening) + reply + bridge + renderer.encode("Fine.") + list(renderer.stop_token_ids[:1])
    assert rollout.tokens.token_id.tolist() == expected
    assert engine.prompts == [list(opening), list(opening) + reply + bridge]  # the second prompt extends the first
    sources = rollout.tokens.source
    assert (sources[len(opening):len(opening) + len(reply)] == Source.MODEL).all()
    assert np.isclose(rollout.tokens.logprob[sources == Source.MODEL], -0.25).all()
    assert rollout.info["env"]["cached"] == len(opening) + 0.0  # usage carries the engine's cached tokens
    assert [t.prompt_end for t in rollout.turns] == [len(opening), len(opening) + len(reply) + len(bridge)]


def test_a_tool_call_comes_back_in_openai_form_and_its_result_is_bridged(renderer):
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                               "parameters": {"type": "object", "properties": {
                                                   "a": {"type": "number"}, "b": {"type": "number"}}}}}]
    seen = {}

    async def agent(task, client):
        history = [user("2+3?")]
        first = await client.chat.completions.create(model="smol", messages=history, tools=tools)
        message = first.choices[0].message
        seen["finish"], seen["calls"] = first.choices[0].finish_reason, message.tool_calls
        history.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = sum(json.loads(call.function.arguments).values())
            history.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
        stream = await client.chat.completions.create(model="smol", messages=history, tools=tools, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return 1.0 if "5" in text else 0.0

    rollout, engine = play(renderer, agent, replies=(call_text, "It is 5."))
    assert rollout.status == "ok" and rollout.reward == 1.0
    assert seen["finish"] == "tool_calls"
    (call,) = seen["calls"]
    assert call.id == "call_0_0" and call.function.name == "add" and json.loads(call.function.arguments) == {
        "a": 2, "b": 3}
    assert engine.prompts[1][:len(engine.prompts[0])] == engine.prompts[0]  # extended, never re-rendered
    assert rollout.info["messages"][2] == {"role": "tool", "content": "5", "tool_call_id": "call_0_0"}
    assert rollout.info["tools"] == tools


def test_reasoning_dropped_by_the_client_is_still_the_same_reply(renderer):
    async def agent(task, client):
        history = [user("hi")]
        first = await client.chat.completions.create(model="smol", messages=history)
        history += [{"role": "assistant", "content": first.choices[0].message.content}, user("more")]
        await client.chat.completions.create(model="smol", messages=history)
        return 1

    rollout, _ = play(renderer, agent)
    assert rollout.status == "ok" and len(rollout.turns) == 2


# ---------------------------------------------------------------------------
# History breaks and refused requests
# ---------------------------------------------------------------------------


def _break_after_one(edit, tools=None):
    async def agent(task, client):
        history = [{"role": "system", "content": "S"}, user("hi")]
        first = await client.chat.completions.create(model="smol", messages=history)
        history += [first.choices[0].message.model_dump(exclude_none=True), user("next")]
        history = edit(history)
        extra = {"tools": tools} if tools else {}
        second = await client.chat.completions.create(model="smol", messages=history, **extra)
        return {"reward": 1.0, "metrics": {"second_prompt": second.usage.prompt_tokens}}
    return agent


@pytest.mark.parametrize("edit,where", [
    (lambda h: [h[0], {**h[1], "content": "HI"}, *h[2:]], (1, "user", "content", "message 1 (user): content differs")),
    (lambda h: h[1:], (0, "system", "dropped", "message 0 (system) was dropped")),
    (lambda h: [h[0], h[2], h[3]], (1, "user", "dropped", "message 1 (user) was dropped")),
    (lambda h: [h[0], h[1], {**h[2], "content": "summary"}, h[3]],
     (2, "assistant", "content", "message 2 (assistant): content differs")),
    (lambda h: [h[1], h[0], *h[2:]], (0, "system", "role", "message 0 (system): role differs")),
    (lambda h: h[:3], (None, None, "nothing_new", "no new message after the 3 recorded")),
    (lambda h: h[:2], (2, "assistant", "dropped", "message 2 (assistant) and after were dropped")),
    (lambda h: h[:1], (1, "user", "dropped", "message 1 (user) and after were dropped")),
    (lambda h: [*h[:3], {"role": "system", "content": "new rules"}],
     (3, "system", "appended", "message 3 (system) was appended")),
])
def test_a_rewritten_history_goes_on_in_a_new_segment_that_says_where_it_broke(renderer, edit, where):
    rollout, engine = play(renderer, _break_after_one(edit), replies=("Hello.", "Again."))
    assert rollout.status == "ok" and rollout.reward == 1.0 and len(rollout.turns) == 2
    (brk,) = rollout.info["segments"]
    assert (brk["message"], brk["role"], brk["field"]) == where[:3] and brk["what"].startswith(where[3])
    first, second = rollout.segments()
    assert brk["turn"] == 1 and brk["start"] == len(first.tokens) == rollout.turns[1].prompt_start
    # the new segment is the request's own messages rendered afresh, and the engine saw exactly that prompt
    from verbatim.agents import messages as chat_messages

    history = edit([{"role": "system", "content": "S"}, user("hi"), {"role": "assistant", "content": "Hello."},
                    user("next")])
    fresh = renderer.render([chat_messages.as_message(chat_messages.canonical(m, 0)) for m in history],
                            add_generation_prompt=True).token_ids
    assert engine.prompts[1] == list(fresh) == second.tokens.token_id[:second.turns[0].prompt_end].tolist()
    assert rollout.info["env"]["second_prompt"] == len(fresh)
    assert second.info["segment"] == 1 and second.turns[0].prompt_start == 0
    assert [m["content"] for m in second.info["messages"]][-1] == "Again."
    assert first.tokens.token_id.tolist() + second.tokens.token_id.tolist() == rollout.tokens.token_id.tolist()


def test_changed_tools_start_a_new_segment(renderer):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    rollout, _ = play(renderer, _break_after_one(lambda h: h, tools=tools))
    (brk,) = rollout.info["segments"]
    assert brk["field"] == "tools" and brk["tools_changed"] and rollout.info["tools"] is None


def test_a_second_request_in_flight_is_409(renderer):
    async def agent(task, client):
        calls = [client.chat.completions.create(model="smol", messages=[user("hi")]) for _ in range(2)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        conflict = [r for r in results if isinstance(r, openai.ConflictError)]
        assert len(conflict) == 1 and "one at a time" in conflict[0].message
        return 1.0

    rollout, _ = play(renderer, agent, delay_s=0.3)
    assert rollout.status == "ok" and len(rollout.turns) == 1


def test_past_the_context_a_request_is_400_naming_the_limit_and_the_rollout_truncated(renderer):
    async def agent(task, client):
        history = [user("hi")]
        first = await client.chat.completions.create(model="smol", messages=history)
        history += [first.choices[0].message.model_dump(exclude_none=True), user("word " * 400)]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="smol", messages=history)
        assert refused.value.code == "context_length_exceeded" and "256-token context" in refused.value.message
        return 0.25

    rollout, engine = play(renderer, agent, budget=256)
    assert rollout.status == "truncated" and "context" in rollout.error and rollout.reward == 0.25
    assert len(engine.prompts) == 1


def test_past_max_turns_a_request_is_400_and_the_rollout_truncated(renderer):
    async def agent(task, client):
        history = [user("hi")]
        for _ in range(3):
            reply = await client.chat.completions.create(model="smol", messages=history)
            history += [reply.choices[0].message.model_dump(exclude_none=True), user("again")]
        return 1.0

    rollout, _ = play(renderer, agent, max_turns=2)
    assert rollout.status == "truncated" and rollout.error.startswith("max turns (2) reached")
    assert "then the agent raised BadRequestError" in rollout.error and rollout.reward is None
    assert len(rollout.turns) == 2


def test_sampling_fields_are_ignored_and_counted(renderer):
    async def agent(task, client):
        await client.chat.completions.create(model="smol", messages=[user("hi")], temperature=0.0, top_p=0.5,
                                             max_tokens=3, logit_bias={"1": 5}, seed=7, tool_choice="none")
        return 1.0

    rollout, _ = play(renderer, agent)
    assert rollout.status == "ok"
    assert rollout.info["agent"]["ignored_fields"] == {"logit_bias": 1, "max_tokens": 1, "seed": 1,
                                                       "temperature": 1, "tool_choice": 1, "top_p": 1}


# ---------------------------------------------------------------------------
# The HTTP surface: keys, hosts, routes, bodies
# ---------------------------------------------------------------------------


def test_unknown_rollouts_bad_bodies_wrong_keys_and_foreign_hosts_are_refused(renderer):
    async def agent(task, client):
        base = str(client.base_url).rstrip("/")
        port = base.split(":")[2].split("/")[0]
        key = {"Authorization": f"Bearer {client.api_key}"}
        async with httpx.AsyncClient() as http:
            models = await http.get(f"{base}/models", headers=key)
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "smol"
            other = await http.post(base.replace("g0000-r00", "nope") + "/chat/completions", headers=key, json={})
            assert other.status_code == 404 and "nope" in other.json()["error"]["message"]
            bad = await http.post(f"{base}/chat/completions", headers=key, content=b"{not json")
            assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
            empty = await http.post(f"{base}/chat/completions", headers=key, json={"messages": []})
            assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"
            wrong_role = await http.post(f"{base}/chat/completions", headers=key,
                                         json={"messages": [{"role": "robot", "content": "x"}]})
            assert wrong_role.status_code == 400 and "messages[0].role" in wrong_role.json()["error"]["message"]
            no_key = await http.get(f"{base}/models")
            assert no_key.status_code == 401
            rebound = await http.get(f"{base}/models", headers={**key, "Host": f"attacker.example:{port}"})
            assert rebound.status_code == 403
        return 1.0

    rollout, _ = play(renderer, agent)
    assert rollout.error == "the agent returned without asking the model for a completion"


# ---------------------------------------------------------------------------
# Agents that fail are data
# ---------------------------------------------------------------------------


def test_an_agent_that_raises_times_out_or_returns_garbage_is_an_error_rollout(renderer):
    async def raises(task, client):
        await client.chat.completions.create(model="smol", messages=[user("hi")])
        raise RuntimeError("tool crashed")

    async def hangs(task, client):
        await asyncio.sleep(30)

    async def garbage(task, client):
        await client.chat.completions.create(model="smol", messages=[user("hi")])
        return "great"

    def sync_agent(task, client):
        reply = client.chat.completions.create(model="smol", messages=[user(task["q"])])
        return {"reward": float(len(reply.choices[0].message.content))}

    rollout, _ = play(renderer, raises)
    assert rollout.status == "error" and "RuntimeError: tool crashed" in rollout.error and len(rollout.turns) == 1
    rollout, _ = play(renderer, hangs, timeout_s=0.5)
    assert rollout.status == "error" and "timed out after 0.5s" in rollout.error
    rollout, _ = play(renderer, garbage)
    assert rollout.status == "error" and "returned 'great'" in rollout.error
    rollout, _ = play(renderer, sync_agent)
    assert rollout.status == "ok" and rollout.reward == len("Hello.")


COMMAND_AGENT = """
import json, sys
from openai import OpenAI
task = json.load(sys.stdin)
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from verbatim
reply = client.chat.completions.create(model="any", messages=[{"role": "user", "content": task["q"]}])
print("some log line")
print(json.dumps({"reward": len(reply.choices[0].message.content), "solved": True}))
"""


@pytest.mark.parametrize("script,status,words", [
    (COMMAND_AGENT, "ok", None),
    ("import sys; sys.stderr.write('no such tool\\n'); sys.exit(3)", "error", "exited with 3: no such tool"),
    ("print('done, no result')", "error", "last line is not JSON"),
    ("pass", "error", "printed no result"),
    ("import time, subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
     "time.sleep(60)", "error", "timed out after 2s"),
])
def test_an_agent_command_gets_the_endpoint_in_its_environment_and_the_task_on_stdin(
        renderer, tmp_path, script, status, words):
    import shlex
    import sys

    from verbatim.agents.loader import load_agent_command

    path = tmp_path / "agent.py"
    path.write_text(script)
    agent = load_agent_command(f"{shlex.quote(sys.executable)} {shlex.quote(str(path))}").make()
    engine = ScriptedEngine(renderer, ("Hello.",))

    async def go():
        async with AgentPlayer(engine, renderer, LoopConfig(), timeout_s=2.0) as player:
            spec = RolloutSpec(run_id="run", group_id="g0000", rollout_id="g0000-r00", task={"q": "hi"}, seed=0)
            return await player.play(spec, agent)

    rollout = asyncio.run(go())
    assert rollout.status == status, rollout.error
    if words is None:
        assert rollout.reward == len("Hello.") and rollout.info["env"]["solved"] is True and len(rollout.turns) == 1
    else:
        assert words in rollout.error


@pytest.mark.parametrize("value,reward", [(1, 1.0), (0.5, 0.5), ({"reward": -2}, -2.0),
                                          ({"reward": 1, "solved": False, "metrics": {"steps": 3}}, 1.0)])
def test_results_an_agent_may_return(value, reward):
    assert read_result(value).reward == reward


@pytest.mark.parametrize("value,words", [(True, "returned True"), (None, "returned None"), (math.nan, "returned nan"),
                                         ({"score": 1}, "unknown keys"), ({"reward": "1"}, "not a finite number"),
                                         ({"reward": 1, "solved": 1}, "solved is 1"),
                                         ({"reward": 1, "metrics": {"x": "y"}}, "metrics")])
def test_results_that_are_refused_say_what_to_return(value, words):
    with pytest.raises(ValueError, match=words):
        read_result(value)


# ---------------------------------------------------------------------------
# Loading --agent
# ---------------------------------------------------------------------------


def test_agents_load_from_a_file_or_a_module(tmp_path):
    path = tmp_path / "my_agent.py"
    path.write_text("async def play(task, client):\n    return 1\n\ndef two(a):\n    return a\n\nX = 3\n")
    assert load_agent(f"{path}:play").make().is_async
    import operator

    assert load_agent("operator:add").make().function is operator.add
    for spec, words in [(f"{path}:nope", "has no 'nope'"), (f"{path}:two", "does not take (task, client)"),
                        (f"{path}:X", "is not a function"), (f"{tmp_path}/missing.py:play", "is not a file"),
                        ("no_such_module_xyz:play", "cannot import"), (str(path), "names no function")]:
        with pytest.raises(InputError, match=words.replace("(", r"\(").replace(")", r"\)")):
            load_agent(spec)
    broken = tmp_path / "broken.py"
    broken.write_text("raise ValueError('boom')\n")
    with pytest.raises(InputError, match="raised ValueError: boom"):
        load_agent(f"{broken}:play")


# ---------------------------------------------------------------------------
# The comparison rule (pure)
# ---------------------------------------------------------------------------

MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                 "content": st.text(max_size=8)})


@settings(max_examples=200, deadline=None)
@given(st.lists(MESSAGE, min_size=1, max_size=6), st.lists(MESSAGE, max_size=3), st.data())
def test_only_an_extension_passes_and_any_edit_names_its_message(recorded, added, data):
    recorded = chat.canonical_all(recorded)
    incoming = recorded + chat.canonical_all(added) if added else list(recorded)
    assert chat.first_difference(recorded, incoming) is None
    index = data.draw(st.integers(0, len(recorded) - 1))
    edited = [dict(m) for m in incoming]
    edited[index]["content"] += "<<edited>>"  # longer than any recorded content: an edit, not a drop
    role = recorded[index]["role"]
    assert chat.first_difference(recorded, edited) == {"message": index, "role": role, "field": "content",
                                                       "what": f"message {index} ({role}): content differs"}
    assert chat.first_difference(recorded, incoming[:index])["field"] == "dropped"


def test_messages_left_out_before_kept_ones_are_dropped_not_edited():
    recorded = chat.canonical_all([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                   {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}])
    found = chat.first_difference(recorded, [*recorded[2:], {"role": "user", "content": "e"}])
    assert (found["message"], found["field"], found["what"]) == (0, "dropped",
                                                                "messages 0-1 (user, assistant) were dropped")


def test_canonical_forms_of_what_clients_send():
    parts = chat.canonical({"role": "developer", "content": [{"type": "text", "text": "a"},
                                                             {"type": "text", "text": "b"}]}, 0)
    assert parts == {"role": "system", "content": "ab"}
    call = chat.canonical({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}, 1)
    assert call == {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "f",
                                                                        "arguments": '{"x": 1}'}]}
    with pytest.raises(chat.BadRequest, match="only text parts"):
        chat.canonical({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, 0)


# ---------------------------------------------------------------------------
# The command line: one of --env, --agent, --agent-cmd, before any work
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["run", "train"])
@pytest.mark.parametrize("extra,needle", [
    ([], "give one of --env NAME, --agent FILE.py:FUNCTION or --agent-cmd"),
    (["--env", "guess", "--agent", "x.py:f"], "not --env and --agent"),
    (["--agent", "x.py:f", "--agent-cmd", "node a.js"], "not --agent and --agent-cmd"),
    (["--agent", "nowhere/x.py:f"], "nowhere/x.py is not a file"),
    (["--agent-cmd", " "], "--agent-cmd is empty"),
    (["--agent", "operator:add"], "has no task generator"),
])
def test_the_agent_flags_are_checked_before_anything_starts(tmp_path, command, extra, needle):
    from typer.testing import CliRunner

    from verbatim.cli.app import app

    out = tmp_path / "never"
    result = CliRunner().invoke(app, [command, *extra, "--out", str(out)])
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert not out.exists()
