"""``--agent-cmd "CMD …"``: an agent in any language, run as one process per rollout.

The process gets the rollout's endpoint in ``OPENAI_BASE_URL`` and its key in ``OPENAI_API_KEY`` (what the
official OpenAI clients of every language read), the task as one JSON object on stdin, and answers with its
result as the last line of stdout: a number, or ``{"reward": …, "solved": …, "metrics": {…}}``. It runs in
a process group of its own, so an agent past ``--agent-timeout`` is killed with everything it started.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from dataclasses import dataclass
from typing import Any

from verbatim.harness.rollout import Ended

STDERR_SHOWN = 300
"""Characters of a failed command's stderr its rollout's error repeats."""


@dataclass(frozen=True)
class CommandAgent:
    """The command line, run through the shell once per rollout."""

    command: str

    @property
    def name(self) -> str:
        return self.command

    async def run(self, task: dict[str, Any], url: str, key: str, timeout_s: float) -> Any:
        """The parsed last line of the command's stdout; :class:`Ended` for a command that failed or hung."""
        env = {**os.environ, "OPENAI_BASE_URL": url, "OPENAI_API_KEY": key}
        process = await asyncio.create_subprocess_shell(
            self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
        try:
            out, err = await asyncio.wait_for(process.communicate(json.dumps(task).encode()), timeout_s)
        except asyncio.TimeoutError:
            _kill(process)
            await process.wait()
            raise Ended("error", f"the agent command timed out after {timeout_s:g}s") from None
        except asyncio.CancelledError:
            _kill(process)
            raise
        if process.returncode != 0:
            raise Ended("error", f"the agent command exited with {process.returncode}: {_tail(err)}")
        lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
        if not lines:
            raise Ended("error", "the agent command printed no result (its last stdout line is the result)")
        try:
            return json.loads(lines[-1])
        except ValueError:
            raise Ended("error", f"the agent command's last line is not JSON: {lines[-1][:120]!r}") from None


def _kill(process: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(err: bytes) -> str:
    text = " ".join(err.decode(errors="replace").split())
    return (text[-STDERR_SHOWN:] if len(text) > STDERR_SHOWN else text) or "(nothing on stderr)"
