"""Built-in environments and the env/task loaders: determinism, scripted episodes, malformed input."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from importlib.metadata import EntryPoint

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verbatim.datamodel import Message, ToolCall
from verbatim.envs import registry
from verbatim.envs.answers import final_number, numbers_match
from verbatim.envs.base import Env, EnvFactory, StepResult
from verbatim.envs.guess import in_words
from verbatim.envs.longdoc import TOWNS, build_register
from verbatim.envs.registry import BUILTIN_ENVS, EnvClassFactory, env_names, load_env
from verbatim.envs.taskfile import load_tasks
from verbatim.envs.tool_functions import TOOL_DEFINITIONS, format_number
from verbatim.errors import InputError
from verbatim.renderers.chatml import ChatML


def assistant(content: str = "", calls: tuple[ToolCall, ...] = (), problems: tuple[str, ...] = ()) -> Message:
    return Message(role="assistant", content=content, tool_calls=calls, problems=problems)


def parsed(text: str) -> Message:
    """``text`` as the SmolLM2/ChatML renderer parses a finished completion (tool calls included)."""
    return ChatML.parse_text(object.__new__(ChatML), text, finished=True)


def play(env: Env, task: dict, replies: list[Message]) -> tuple[float, list[StepResult]]:
    env.reset(task, seed=0)
    results = []
    for reply in replies:
        results.append(env.step(reply))
        if results[-1].done:
            break
    return sum(r.reward for r in results), results


# -- loading ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(BUILTIN_ENVS))
def test_builtin_envs_load_and_make_envs(name):
    factory = load_env(name)
    assert isinstance(factory, EnvFactory) and factory.name == name
    env = factory.make()
    assert isinstance(env, Env) and env.name == name
    reset = env.reset(factory.tasks(1, seed=0)[0], seed=0)
    assert [m.role for m in reset.messages] == ["system", "user"]


def test_factory_options_pass_through_and_bad_options_are_input_errors():
    assert load_env("longdoc", words=120).tasks(1, 0)[0]["words"] == 120
    assert {t["high"] for t in load_env("guess", high=10).tasks(5, 0)} == {10}
    with pytest.raises(InputError, match="does not take"):
        load_env("guess", colour="red")


def test_unknown_name_suggests_the_closest():
    with pytest.raises(InputError) as caught:
        load_env("gues")
    assert "did you mean 'guess'" in caught.value.one_line()
    with pytest.raises(InputError) as caught:
        load_env("zzzzzz")
    assert "known envs: tools, guess, longdoc, python" in caught.value.one_line()


USER_MODULE = '''
from verbatim.datamodel import Message
from verbatim.envs.base import Reset, StepResult

class EchoEnv:
    name = "echo"
    def __init__(self, word="hi"):
        self.word = word
    def reset(self, task, seed):
        return Reset(messages=(Message(role="user", content=task["say"]),))
    def step(self, message):
        return StepResult(reward=float(message.content == self.word), done=True)

class EchoFactory:
    name = "echo"
    def __init__(self, word="hi"):
        self.word = word
    def make(self):
        return EchoEnv(self.word)
    def tasks(self, count, seed):
        return [{"say": f"say {self.word}"} for _ in range(count)]

NOT_AN_ENV = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"user_envs_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_module_class_loads_a_factory_with_options(user_module):
    factory = load_env(f"{user_module}:EchoFactory", word="yo")
    reward, _ = play(factory.make(), factory.tasks(1, 0)[0], [assistant("yo")])
    assert factory.tasks(1, 0) == [{"say": "say yo"}] and reward == 1.0


def test_module_env_class_gets_a_factory_that_asks_for_a_task_file(user_module):
    factory = load_env(f"{user_module}:EchoEnv")
    assert isinstance(factory, EnvClassFactory) and factory.name == "echo"
    assert play(factory.make(), {"say": "x"}, [assistant("hi")])[0] == 1.0
    with pytest.raises(InputError) as caught:
        factory.tasks(1, 0)
    assert "give a task file with --tasks FILE" in caught.value.one_line()
    with pytest.raises(InputError, match="does not take"):
        load_env(f"{user_module}:EchoEnv", colour="red")


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:Env", "cannot import env module"),
    ("verbatim.envs.guess:GuesFactory", "did you mean GuessFactory"),
    ("verbatim.envs.guess:", "must look like"),
    ("verbatim.envs.longdoc:TOWNS", "is not an env"),
])
def test_bad_module_paths_are_input_errors(spec, message):
    with pytest.raises(InputError) as caught:
        load_env(spec)
    assert message in caught.value.one_line()


def test_entry_points_are_found_by_name(user_module, monkeypatch):
    point = EntryPoint(name="echo", value=f"{user_module}:EchoFactory", group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [point] if group == registry.ENTRY_POINT_GROUP else [])
    assert env_names() == [*BUILTIN_ENVS, "echo"]
    assert load_env("echo").tasks(1, 0) == [{"say": "say hi"}]


def test_load_tasks_reads_objects_and_skips_blank_lines(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"target": 3}\n\n{"target": 4, "high": 9}\n')
    assert load_tasks(path) == [{"target": 3}, {"target": 4, "high": 9}]


@pytest.mark.parametrize("text, message", [
    ('{"a": 1}\n{"a": 2}\n{"a": \n', "tasks.jsonl line 3: invalid JSON"),
    ('{"a": 1}\n[1, 2]\n', "tasks.jsonl line 2: a task must be a JSON object, got list"),
    ("\n  \n", "has no tasks"),
])
def test_malformed_task_files_name_the_line(tmp_path, text, message):
    path = tmp_path / "tasks.jsonl"
    path.write_text(text)
    with pytest.raises(InputError) as caught:
        load_tasks(path)
    assert message in caught.value.one_line()


def test_missing_task_file_and_bad_task_fields_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_tasks(tmp_path / "nope.jsonl")
    with pytest.raises(InputError, match="guess task: target"):
        load_env("guess").make().reset({"low": 1}, seed=0)
    with pytest.raises(InputError, match="outside 1..50"):
        load_env("guess").make().reset({"target": 99}, seed=0)


# -- deterministic tasks ---------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(["tools", "guess", "longdoc", "python"]), seed=st.integers(0, 2**32),
       count=st.integers(1, 6))
def test_tasks_are_a_pure_function_of_the_seed(name, seed, count):
    options = {"words": 80} if name == "longdoc" else {}
    first = load_env(name, **options).tasks(count, seed)
    assert len(first) == count
    assert json.loads(json.dumps(first)) == first == load_env(name, **options).tasks(count, seed)
    for task in first:  # every generated task is one the env accepts
        load_env(name, **options).make().reset(task, seed=1)


@pytest.mark.parametrize("name", list(BUILTIN_ENVS))
def test_different_seeds_give_different_tasks(name):
    factory = load_env(name)
    assert factory.tasks(4, seed=1) != factory.tasks(4, seed=2)


@settings(max_examples=200, deadline=None)
@given(value=st.one_of(st.integers(-10**9, 10**9), st.decimals(-10**6, 10**6, places=2).map(float)))
def test_tool_results_read_back_as_the_same_answer(value):
    written = format_number(value)
    for reply in (f"Answer: {written}", f"The total is {written}.", f"answer = {written} (I used 2 tools)"):
        assert numbers_match(final_number(reply), value), reply
    assert not numbers_match(final_number(f"Answer: {format_number(value + 0.01)}"), value)


# -- guess -----------------------------------------------------------------------------------------

def bisect(env: Env, task: dict) -> tuple[float, list[StepResult]]:
    low, high = task["low"], task["high"]
    env.reset(task, seed=0)
    results = []
    while True:
        guess = (low + high) // 2
        results.append(env.step(assistant(f"{guess}")))
        text = results[-1].messages[0].content
        if results[-1].done:
            return sum(r.reward for r in results), results
        low, high = (guess + 1, high) if text.startswith("Higher") else (low, guess - 1)


@settings(max_examples=50, deadline=None)
@given(target=st.integers(1, 50))
def test_guess_feedback_lets_bisection_win(target):
    reward, results = bisect(load_env("guess").make(), {"target": target, "low": 1, "high": 50, "max_guesses": 6})
    assert reward == 1.0 and results[-1].info["solved"] and len(results) <= 6


def test_guess_wrong_and_malformed_replies_lose_without_raising():
    env, task = load_env("guess").make(), {"target": 17, "max_guesses": 4}
    reward, results = play(env, task, [assistant(""), assistant("no idea"), assistant("99"), assistant("16")])
    assert reward == 0.0 and results[-1].done and len(results) == 4
    texts = [r.messages[0].content for r in results]
    assert texts[0].startswith("Reply with one whole number") and "99 is outside 1 to 50" in texts[2]
    assert texts[3] == "Out of guesses. The number was 17."


@settings(max_examples=60, deadline=None)
@given(target=st.integers(1, 12), guesses=st.integers(1, 100), replies=st.lists(st.integers(1, 12), max_size=8))
def test_guess_text_names_no_number_but_the_range_so_an_echo_is_not_a_counter_guess(target, guesses, replies):
    """A policy that echoes the prompt guesses the first number it echoes: only a bound may be one."""
    env = load_env("guess").make()
    task = {"target": target, "low": 1, "high": 12, "max_guesses": guesses}
    opening = env.reset(task, seed=0).messages
    texts = [m.content for m in opening]
    for reply in replies:
        result = env.step(assistant(f"{reply}"))
        if result.done:
            break
        texts.append(result.messages[0].content)
    named = {int(n) for text in texts for n in re.findall(r"\d+", text)}
    assert named <= {1, 12}, texts
    assert "guess" in texts[1] and ("guesses" in texts[1]) == (guesses != 1)


def test_guess_counts_are_words():
    env = load_env("guess").make()
    opening = env.reset({"target": 2, "low": 1, "high": 5, "max_guesses": 3}, seed=0).messages[1].content
    assert "You have three guesses." in opening
    texts = [env.step(assistant(reply)).messages[0].content for reply in ("1", "4")]
    assert texts == ["Higher. Two guesses left.", "Lower. One guess left."]
    assert [in_words(n) for n in (0, 7, 19, 20, 42, 99, 100)] == [
        "zero", "seven", "nineteen", "twenty", "forty-two", "ninety-nine", "one hundred"]


# -- tools -----------------------------------------------------------------------------------------

def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


def test_tools_shopping_episode_through_the_chatml_parser():
    factory = load_env("tools")
    task = next(t for t in factory.tasks(6, seed=5) if t["kind"] == "shopping")
    n1, item1, n2, item2 = re.search(r"what do (\d+) (\w+)s and (\d+) (\w+)s", task["question"]).groups()
    env = factory.make()
    reset = env.reset(task, seed=0)
    assert reset.tools == TOOL_DEFINITIONS and "<tool_call>" in reset.messages[0].content
    text = "".join(f'<tool_call>\n{{"name": "price", "arguments": {{"item": "{i}"}}}}\n</tool_call>'
                   for i in (item1, item2))
    first = env.step(parsed(text))
    assert [(m.role, m.name, m.tool_call_id) for m in first.messages] == [
        ("tool", "price", "call_1_0"), ("tool", "price", "call_1_1")]
    p1, p2 = (float(m.content) for m in first.messages)
    assert (p1, p2) == (task["prices"][item1], task["prices"][item2]) and not first.done
    total = env.step(assistant(calls=(call("multiply", a=int(n1), b=p1), call("multiply", a=int(n2), b=p2))))
    a, b = (float(m.content) for m in total.messages)
    summed = env.step(assistant(calls=(call("add", a=a, b=b),)))
    final = env.step(parsed(f"The total is {summed.messages[0].content}. Answer: {summed.messages[0].content}"))
    assert final.done and final.reward == 1.0 and final.info["correct"] and final.info["tool_calls"] == 5


def test_tools_convert_and_arithmetic_answers_are_checked():
    factory = load_env("tools")
    for task in factory.tasks(6, seed=11):
        right = play(factory.make(), task, [assistant(f"Answer: {task['answer']}")])[0]
        wrong = play(factory.make(), task, [assistant(f"Answer: {task['answer'] + 1}")])[0]
        assert (right, wrong) == (1.0, 0.0), task


def test_tools_errors_are_observations():
    env = load_env("tools").make()
    env.reset({"question": "q?", "answer": 3, "max_steps": 4}, seed=0)
    result = env.step(assistant(calls=(call("divide", a=1, b=2), call("add", a="x", b=1), call("add", a=1),
                                       call("convert", value=1, from_unit="kg", to_unit="km"),
                                       call("price", item="gold"))))
    texts = [m.content for m in result.messages]
    assert all(t.startswith("error: ") for t in texts) and "unknown tool 'divide'" in texts[0]
    assert "cannot convert mass (kg) to length (km)" in texts[3] and not result.done
    broken = env.step(parsed('<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call>'))
    assert broken.messages[-1].role == "user" and "could not be read" in broken.messages[-1].content
    empty = env.step(assistant(""))
    assert empty.messages[0].content.startswith("No answer found") and not empty.done
    last = env.step(assistant(calls=(call("add", a=1, b=2),)))
    assert last.done and last.reward == 0.0 and last.info["out_of_steps"]


# -- longdoc ---------------------------------------------------------------------------------------

def test_longdoc_document_is_long_deterministic_and_states_every_answer():
    document, people = build_register(doc_seed=7, words=2500)
    assert 2500 <= len(document.split()) < 2700 and build_register(7, 2500)[0] == document
    assert len({p["name"] for p in people}) == len(people)
    task = load_env("longdoc").tasks(1, seed=3)[0]
    document, people = build_register(task["doc_seed"], task["words"])
    for question in task["questions"]:
        name = re.search(r"(?:does|of|was) (\w+ \w+)", question["question"]).group(1)
        paragraph = next(p for p in document.split("\n\n") if name in p)
        assert question["answer"] in paragraph


def test_longdoc_scores_the_fraction_answered_right():
    factory = load_env("longdoc", words=300, questions=3)
    task = factory.tasks(1, seed=9)[0]
    answers = [q["answer"] for q in task["questions"]]
    env = factory.make()
    opening = env.reset(task, seed=0).messages[1].content
    assert opening.startswith("Register of the Valley Guilds") and "Question 1 of 3" in opening
    reward, results = play(env, task, [assistant(f"It is {a}.") for a in answers])
    assert reward == pytest.approx(1.0) and results[-1].info["score"] == pytest.approx(1.0)
    assert [r.messages[0].content[:13] for r in results[:2]] == ["Question 2 of", "Question 3 of"]
    reward, results = play(factory.make(), task, [assistant(answers[0]), assistant(""), assistant("no idea")])
    assert reward == pytest.approx(1 / 3) and results[-1].info["correct"] == [True, False, False]


def test_longdoc_naming_every_town_does_not_score():
    task = {"document": "Ada lives in Varrow.", "questions": [{"question": "Town of Ada?", "answer": "Varrow",
                                                               "kind": "town"}]}
    assert play(load_env("longdoc").make(), task, [assistant(", ".join(TOWNS))])[0] == 0.0
    assert play(load_env("longdoc").make(), task, [assistant("varrow")])[0] == 1.0


# -- python ----------------------------------------------------------------------------------------

LIST = re.compile(r"\[.*?\]")
NUMBER = re.compile(r"\d+")
SOLUTIONS = {
    "sum": lambda p: "a, b = {}, {}\nprint(sum(range(a, b + 1)))".format(*NUMBER.findall(p)[:2]),
    "sort": lambda p: f"print(sorted({LIST.search(p).group()}))",
    "count": lambda p: "print({1!r}.count({0!r}))".format(*re.findall(r"'(\w+)'", p)),
    "factorial": lambda p: f"import math\nprint(math.factorial({NUMBER.search(p).group()}))",
    "extremes": lambda p: f"v = {LIST.search(p).group()}\nprint(max(v) * min(v))",
}


def test_python_scripted_solutions_earn_the_reward_in_the_sandbox():
    factory = load_env("python")
    for task in factory.tasks(5, seed=2):
        code = SOLUTIONS[task["kind"]](task["prompt"])
        reward, results = play(factory.make(), task, [assistant(f"Here:\n```python\n{code}\n```\nDone.")])
        assert reward == 1.0 and results[0].done, (task, results[0].messages[0].content)


def test_python_wrong_then_right_and_malformed_replies():
    factory = load_env("python", max_attempts=3)
    task = {"prompt": "Print 6 times 7.", "expected": "42", "max_attempts": 3}
    reward, results = play(factory.make(), task, [assistant(""), assistant("print(6 + 7)"),
                                                  assistant("```python\nprint(6 * 7)\n```")])
    assert reward == 1.0 and [r.reward for r in results] == [0.0, 0.0, 1.0]
    assert results[0].messages[0].content.startswith("No code found")
    assert "stdout:\n13" in results[1].messages[0].content and "try again" in results[1].messages[0].content
    reward, results = play(factory.make(), task | {"max_attempts": 1}, [assistant("```python\n1/0\n```")])
    assert reward == 0.0 and results[0].done and "ZeroDivisionError" in results[0].messages[0].content


def test_envs_import_no_engine_harness_renderers_torch_or_vllm():
    import subprocess

    code = ("import sys\nfrom verbatim.envs import load_env\n"
            "for name in ('tools', 'guess', 'longdoc', 'python'):\n"
            "    factory = load_env(name)\n    factory.make().reset(factory.tasks(1, 0)[0], 0)\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers') "
            "or m.startswith(('verbatim.engine', 'verbatim.harness', 'verbatim.renderers'))]\nprint(bad)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-500:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


# -- what a run needs to know: solved, and how many turns an episode may take ----------------------

def test_every_builtin_env_says_whether_the_episode_was_solved():
    tools = load_env("tools").tasks(1, seed=11)[0]
    assert play(load_env("tools").make(), tools, [assistant(f"Answer: {tools['answer']}")])[1][-1].info["solved"]
    assert not play(load_env("tools").make(), tools, [assistant("Answer: -1")])[1][-1].info["solved"]
    longdoc = load_env("longdoc", words=300, questions=2)
    task = longdoc.tasks(1, seed=9)[0]
    answers = [q["answer"] for q in task["questions"]]
    assert play(longdoc.make(), task, [assistant(a) for a in answers])[1][-1].info["solved"] is True
    assert play(longdoc.make(), task, [assistant(answers[0]), assistant("no idea")])[1][-1].info["solved"] is False
    python = {"prompt": "Print 6 times 7.", "expected": "42", "max_attempts": 2}
    results = play(load_env("python").make(), python, [assistant("print(6 + 7)"), assistant("print(6 * 7)")])[1]
    assert [r.info["solved"] for r in results] == [False, True]


def test_default_max_turns_covers_every_builtin_episode_and_a_task_files_own_limit(user_module):
    limits = {"guess": 6, "tools": 6, "python": 2, "longdoc": 3}
    for name, turns in limits.items():
        factory = load_env(name)
        assert registry.default_max_turns(factory, factory.tasks(2, 0)) == turns, name
    guess = load_env("guess")
    tasks = [{"target": 3}, {"target": 4, "max_guesses": 9}]
    assert registry.default_max_turns(guess, tasks) == 9
    plain = load_env(f"{user_module}:EchoEnv")
    assert registry.default_max_turns(plain, [{"say": "x"}]) == registry.FALLBACK_MAX_TURNS
