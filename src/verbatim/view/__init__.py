"""``verbatim view``: a local, read-only web page of a run directory (server, data, static assets)."""
