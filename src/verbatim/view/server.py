"""``verbatim view``'s server: one read-only page on loopback, and the JSON it fetches.

Standard library only (``http.server``): the page is static files shipped in the
package (``verbatim/view/static``) plus four GET endpoints under ``/api/``. Every answer
carries a strict Content-Security-Policy: scripts only from this server, no inline
script, no other origin. ``static_page`` writes the same page as one self-contained
file, the answers embedded as inert JSON and the script allowed by its hash alone.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from verbatim.errors import VerbatimError
from verbatim.loopback import HOST, host_allowed
from verbatim.view.run_data import RunData, everything

SCRIPTS = ("chart.js", "tokens.js", "view.js")
ASSETS = {"view.css": "text/css; charset=utf-8", **{name: "text/javascript; charset=utf-8" for name in SCRIPTS}}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                    "Cache-Control": "no-store", "Cross-Origin-Resource-Policy": "same-origin"}


def asset(name: str) -> str:
    return resources.files("verbatim.view").joinpath("static", name).read_text(encoding="utf-8")


def json_bytes(value: Any) -> bytes:
    """JSON with every ``<``, ``>`` and ``&`` escaped, so no trace text can close an enclosing tag."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode("utf-8")


class ViewHandler(BaseHTTPRequestHandler):
    data: RunData  # set on the subclass that make_server builds
    server_version = "verbatim-view"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if not host_allowed(self.headers.get("Host"), self.server.server_address[1]):
            self._send(HTTPStatus.FORBIDDEN, b"this page answers only requests to its loopback address",
                       "text/plain; charset=utf-8")  # a DNS-rebinding page must not read the traces
            return
        url = urlsplit(self.path)
        query = {key: values[0] for key, values in parse_qs(url.query).items()}
        if url.path == "/":
            self._send(HTTPStatus.OK, asset("index.html").encode(), "text/html; charset=utf-8")
        elif url.path.startswith("/static/") and url.path.removeprefix("/static/") in ASSETS:
            name = url.path.removeprefix("/static/")
            self._send(HTTPStatus.OK, asset(name).encode(), ASSETS[name])
        elif url.path.startswith("/api/"):
            self._api(url.path.removeprefix("/api/"), query)
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain; charset=utf-8")

    def do_POST(self) -> None:  # noqa: N802 - read-only: nothing is ever written
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"read-only", "text/plain; charset=utf-8")

    do_PUT = do_DELETE = do_PATCH = do_POST  # noqa: N815

    def _api(self, name: str, query: dict[str, str]) -> None:
        answers = {"summary": lambda: self.data.summary(), "rollouts": lambda: self.data.rollout_list(),
                   "rollout": lambda: self.data.rollout(query.get("id", "")),
                   "group": lambda: self.data.group(query.get("id", ""))}
        if name not in answers:
            self._send(HTTPStatus.NOT_FOUND, json_bytes({"error": f"no endpoint {name}"}), "application/json")
            return
        try:
            body, status = json_bytes(answers[name]()), HTTPStatus.OK
        except VerbatimError as exc:
            body, status = json_bytes({"error": exc.one_line()}), HTTPStatus.NOT_FOUND
        self._send(status, body, "application/json; charset=utf-8")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Security-Policy", CSP)
        for key, value in SECURITY_HEADERS.items():
            self.send_header(key, value)
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the page navigated away mid-answer
            pass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: the page is the output
        return


def make_server(run_dir: str | Path, port: int = 0) -> ThreadingHTTPServer:
    """A server for ``run_dir`` bound to 127.0.0.1 (``port`` 0: any free port); not yet serving."""
    data = RunData(run_dir)
    data.refresh()
    handler = type("BoundViewHandler", (ViewHandler,), {"data": data})
    try:
        server = ThreadingHTTPServer((HOST, port), handler)
    except OSError as exc:
        from verbatim.errors import InputError

        raise InputError(f"cannot listen on {HOST}:{port}: {exc.strerror or exc}",
                         hint="pass another --port, or 0 for any free one") from None
    server.daemon_threads = True
    return server


def serve_in_thread(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name="verbatim-view", daemon=True)
    thread.start()
    return thread


def static_page(run_dir: str | Path) -> str:
    """The whole page as one HTML file: styles, script and every answer inline, nothing fetched."""
    data = RunData(run_dir)
    script = "\n".join(asset(name) for name in SCRIPTS)
    style = asset("view.css")
    policy = (f"default-src 'none'; script-src '{_hash(script)}'; style-src '{_hash(style)}'; img-src data:; "
              "base-uri 'none'; form-action 'none'")
    page = asset("index.html")
    page = page.replace('<link rel="stylesheet" href="/static/view.css">', f"<style>{style}</style>")
    scripts = "".join(f'<script src="/static/{name}"></script>\n' for name in SCRIPTS)
    embedded = json_bytes(everything(data)).decode("utf-8")
    page = page.replace(scripts, f'<script type="application/json" id="embedded">{embedded}</script>\n'
                                 f"<script>{script}</script>\n")
    return page.replace("<head>", f'<head>\n<meta http-equiv="Content-Security-Policy" content="{policy}">', 1)


def _hash(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode()
