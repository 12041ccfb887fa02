"""Agents for tests/test_agents_engine.py, written as users write them: against the ``openai`` client.

``play(task, client)`` runs the mode ``task["mode"]`` names: ``tools`` (a tool-calling loop of three
requests, not streamed), ``stream`` (streamed requests with usage, asking for a temperature the run
ignores), ``framework`` (the OpenAI Agents SDK's own tool loop over chat completions) and ``rewrite`` (an
agent that drops its oldest exchange before its third request: a history break). Each returns what its
requests were told in ``metrics``, so the test can hold the answers against the trace.
"""

from __future__ import annotations

import json

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


async def play(task, client):
    return await MODES[task["mode"]](task, client)


async def tools_loop(task, client):
    """Three requests: each reply's tool calls are answered with their results, else the user asks again."""
    history = [{"role": "system", "content": "You can call add(a, b)."}, {"role": "user", "content": task["question"]}]
    metrics = {}
    for k in range(3):
        reply = await client.chat.completions.create(model="smol", messages=history, tools=TOOLS)
        metrics[f"cached_{k}"] = reply.usage.prompt_tokens_details.cached_tokens
        metrics[f"prompt_{k}"] = reply.usage.prompt_tokens
        message = reply.choices[0].message
        history.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                try:
                    result = str(sum(json.loads(call.function.arguments).values()))
                except (ValueError, TypeError, AttributeError):
                    result = "error: arguments must be two integers"
                history.append({"role": "tool", "tool_call_id": call.id, "content": result})
        else:
            history.append({"role": "user", "content": "Please use the add tool."})
    return {"reward": float(str(task["answer"]) in (message.content or "")), "metrics": metrics}


async def streamed(task, client):
    history = [{"role": "user", "content": task["question"]}]
    metrics = {}
    for k in range(2):
        stream = await client.chat.completions.create(model="smol", messages=history, stream=True, temperature=0.2,
                                                      stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
        metrics[f"cached_{k}"] = usage.prompt_tokens_details.cached_tokens
        metrics[f"completion_{k}"] = usage.completion_tokens
        history += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
    return {"reward": float(len(text) > 0), "metrics": metrics}


async def framework(task, client):
    """The OpenAI Agents SDK runs its own loop (tools included) over verbatim's chat completions."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no trace upload: nothing leaves this machine

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    agent = Agent(name="adder", instructions="Answer with the number. Use add.", tools=[add],
                  model=OpenAIChatCompletionsModel(model="smol", openai_client=client))
    result = await Runner.run(agent, task["question"], max_turns=3)
    return {"reward": float(str(task["answer"]) in str(result.final_output)), "solved": False}


async def rewrite(task, client):
    """Keeps only the latest exchange before its third request (a summarising agent's habit)."""
    history = [{"role": "user", "content": task["question"]}]
    for _ in range(2):
        reply = await client.chat.completions.create(model="smol", messages=history)
        history += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And?"}]
    history = history[2:]
    last = await client.chat.completions.create(model="smol", messages=history)
    return {"reward": 0.5, "metrics": {"last_prompt": last.usage.prompt_tokens,
                                       "last_cached": last.usage.prompt_tokens_details.cached_tokens}}


MODES = {"tools": tools_loop, "stream": streamed, "framework": framework, "rewrite": rewrite}
