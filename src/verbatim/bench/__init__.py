"""Benchmarks (`verbatim bench ...`): each measures one claim side by side in one run and rewrites only
its own marked section of a doc (`docsection`)."""
