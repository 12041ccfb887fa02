"""The rule every local server of verbatim follows (``verbatim view``, the agent endpoint): loopback only.

Binding to 127.0.0.1 keeps other machines out, not web pages: a page the user visits can point a name it
controls at 127.0.0.1 (DNS rebinding) and read the answers as same-origin. Such a request carries that name
in its Host header, so a loopback server answers only requests whose Host is a loopback name, with or
without its own port.
"""

from __future__ import annotations

HOST = "127.0.0.1"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def allowed_hosts(port: int) -> frozenset[str]:
    """The Host headers a loopback server on ``port`` answers."""
    return frozenset({f"{name}:{port}" for name in LOOPBACK_NAMES} | set(LOOPBACK_NAMES))


def host_allowed(host: str | None, port: int) -> bool:
    """Whether a request with this Host header may be answered (a missing header may not)."""
    return (host or "").strip().lower() in allowed_hosts(port)
