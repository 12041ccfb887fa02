"""The agent endpoint: an OpenAI-compatible chat completions server, one base URL per rollout.

``http://127.0.0.1:PORT/r/ROLLOUT_ID/v1`` serves ``POST /chat/completions`` (plain and streamed as
server-sent events) and ``GET /models`` for the rollout it names. It listens on loopback only, answers
only requests carrying the run's random key (``Authorization: Bearer …``) and only requests whose Host header
is a loopback name with its own port, so a web page the user visits cannot reach it through DNS rebinding.
It runs on the run's event loop, beside the rollouts it serves.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from verbatim.agents.messages import BadRequest, openai_message
from verbatim.agents.session import AgentSession, Refusal, read_request
from verbatim.loopback import HOST, host_allowed


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Endpoint:
    """The server and the sessions it routes to; :meth:`start` before the first rollout, :meth:`close` after."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.key = "vb-" + secrets.token_urlsafe(24)
        self.sessions: dict[str, AgentSession] = {}
        self.port: int | None = None
        self._server: Any = None
        self._task: asyncio.Task | None = None

    def url(self, rollout_id: str) -> str:
        return f"http://{HOST}:{self.port}/r/{rollout_id}/v1"

    async def start(self) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="error", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the run owns SIGINT/SIGTERM
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
            self._server = self._task = None

    # -- the application ---------------------------------------------------------------

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(routes=[
            Route("/r/{rollout}/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/r/{rollout}/v1/models", self._models, methods=["GET"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed})

    def _refused(self, request: Any) -> Any:
        """A response refusing a request from elsewhere than this machine's loopback, or without the key."""
        from starlette.responses import JSONResponse

        if not host_allowed(request.headers.get("host"), self.port or 0):
            return JSONResponse(error_body("this endpoint answers only requests to its loopback address",
                                           "invalid_request_error", "host_not_allowed"), status_code=403)
        if request.headers.get("authorization", "") != f"Bearer {self.key}":
            return JSONResponse(error_body("missing or wrong API key: use the key verbatim gave the agent",
                                           "invalid_request_error", "invalid_api_key"), status_code=401)
        return None

    def _session(self, request: Any) -> AgentSession:
        rollout = request.path_params["rollout"]
        session = self.sessions.get(rollout)
        if session is None:
            raise Refusal(404, f"no rollout {rollout!r} is playing on this endpoint", "invalid_request_error",
                          "rollout_not_found")
        return session

    async def _models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        refused = self._refused(request)
        if refused is not None:
            return refused
        try:
            self._session(request)
        except Refusal as refusal:
            return _refusal_response(refusal)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "verbatim"}]})

    async def _chat(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        refused = self._refused(request)
        if refused is not None:
            return refused
        try:
            session = self._session(request)
            try:
                chat = read_request(json.loads(await request.body()))
            except (ValueError, RecursionError) as exc:
                param = exc.param if isinstance(exc, BadRequest) else None
                raise Refusal(400, f"bad request: {exc}", "invalid_request_error", None, param) from None
            answer = await session.complete(chat)
        except Refusal as refusal:
            return _refusal_response(refusal)
        except Exception as exc:  # noqa: BLE001 - a bug of ours is the rollout's error, and a 500 to the agent
            session = self.sessions.get(request.path_params["rollout"])
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())
            if session is not None and session.failure is None:
                session.failure = f"the endpoint failed: {reason}"
            return JSONResponse(error_body(reason, "server_error"), status_code=500)
        head = {"id": f"chatcmpl-{session.spec.rollout_id}-{answer['index']}", "created": int(time.time()),
                "model": chat.model or self.model_name}
        if chat.stream:
            return StreamingResponse(_events(head, answer, chat.include_usage), media_type="text/event-stream")
        return JSONResponse({**head, "object": "chat.completion", "usage": answer["usage"], "choices": [
            {"index": 0, "message": openai_message(answer["message"]), "finish_reason": answer["finish_reason"],
             "logprobs": None}]})

    async def _not_found(self, request: Any, exc: Exception) -> Any:
        return _refusal_response(Refusal(404, f"no route {request.url.path}: the agent's base URL ends in /v1 and "
                                              "serves /chat/completions and /models", "invalid_request_error"))

    async def _not_allowed(self, request: Any, exc: Exception) -> Any:
        return _refusal_response(Refusal(405, f"{request.method} is not served on {request.url.path}",
                                         "invalid_request_error"))


def _refusal_response(refusal: Refusal) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(refusal.message, refusal.kind, refusal.code, refusal.param),
                        status_code=refusal.status)


async def _events(head: dict[str, Any], answer: dict[str, Any], include_usage: bool) -> AsyncIterator[str]:
    """The answer as OpenAI's stream of chunks: the role, reasoning, content, tool calls, the finish reason."""
    message = openai_message(answer["message"])

    def chunk(delta: dict[str, Any], finish: str | None = None, usage: Any = None) -> str:
        body = {**head, "object": "chat.completion.chunk",
                "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish,
                                                      "logprobs": None}]}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if message.get("reasoning_content"):
        yield chunk({"reasoning_content": message["reasoning_content"]})
    if message.get("content"):
        yield chunk({"content": message["content"]})
    for index, call in enumerate(message.get("tool_calls", ())):
        yield chunk({"tool_calls": [{"index": index, **call}]})
    yield chunk({}, answer["finish_reason"])
    if include_usage:
        yield chunk(None, usage=answer["usage"])  # type: ignore[arg-type]
    yield "data: [DONE]\n\n"
