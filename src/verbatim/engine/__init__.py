"""Engines (the `Engine` protocol, in-process vLLM, the HTTP backend), the server, the local fleet and
the router with its pure routing decisions. vLLM is imported only here."""
