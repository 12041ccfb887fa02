"""Server URLs: taken apart for a request, and shown without their credentials.

A ``--url`` may carry ``user:password@`` and secret query parameters (``?api_key=…``): the HTTP
backend sends them, and every URL or text it shows goes through :func:`redact` / :func:`redact_text`
first.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from verbatim.errors import InputError

SECRET_PARAMS = ("key", "token", "secret", "password", "passwd", "auth", "signature", "credential")
"""A query parameter whose name contains one of these carries a secret (``api_key``, ``access_token``…)."""

_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")
_BEARER = re.compile(r"\b(Bearer|Basic)\s+[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE)


def redact(url: str) -> str:
    """A URL without ``user:password@`` and without the values of secret query parameters."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # not a URL we can take apart: keep nothing that could be a secret
        return "***"
    if parts.username or parts.password:
        parts = parts._replace(netloc=f"***@{parts.hostname or ''}{':' + str(port) if port else ''}")
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        parts = parts._replace(query="&".join(
            f"{name}={'***' if secret_param(name) else value}" for name, value in pairs))
    return urlunsplit(parts)


def redact_text(text: str, secrets: Sequence[str] = ()) -> str:
    """``text`` with every URL redacted, ``Bearer``/``Basic`` credentials and the given secrets masked."""
    text = _URL.sub(lambda m: redact(m.group(0)), text)
    text = _BEARER.sub(lambda m: f"{m.group(1)} ***", text)
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def secret_param(name: str) -> bool:
    """A query parameter of this name carries a secret."""
    name = name.lower()
    return any(word in name for word in SECRET_PARAMS)


MAX_URL = 2048
"""Characters of a server URL at most (httpx refuses far longer ones; no server address needs more)."""


def split_url(url: str) -> tuple[str, list[tuple[str, str]], tuple[str, str] | None]:
    """(base URL without credentials or query, the query's parameters, (user, password) or None)."""
    if len(url) > MAX_URL:
        raise InputError(f"--url is {len(url):,} characters long: not a server address",
                         hint="use e.g. http://127.0.0.1:8000")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise InputError(f"{redact(url)} is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(f"{redact(url)} is not an http(s) URL", hint="use e.g. http://127.0.0.1:8000")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = f"{host}:{port}" if port else host
    base = urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
    auth = (unquote(parts.username or ""), unquote(parts.password or "")) if parts.username or parts.password \
        else None
    return base, parse_qsl(parts.query, keep_blank_values=True), auth
