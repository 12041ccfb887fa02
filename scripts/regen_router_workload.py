"""Regenerate bench/data/router_workload.json: the turn-length table ``verbatim bench router`` samples.

Reads real ``verbatim run`` directories and keeps, per group, the length of the shared
first prompt and each rollout's first prompt, completions and observations, plus the
cost model fitted to the runs' engine timings (no token ids, no text). For example:

    verbatim run --env guess --groups 4 --group-size 8 --max-turns 6 --out /tmp/simtrace_guess
    verbatim run --env longdoc --groups 4 --group-size 8 --max-turns 6 --out /tmp/simtrace_longdoc
    .venv/bin/python scripts/regen_router_workload.py /tmp/simtrace_guess /tmp/simtrace_longdoc

and review the diff. The bench and the tests read this file and never write it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(run_dirs: list[str]) -> None:
    from verbatim.bench.router import WORKLOAD_FILE, load_workload

    if not run_dirs:
        raise SystemExit(__doc__)
    workload = load_workload([Path(d) for d in run_dirs])
    WORKLOAD_FILE.parent.mkdir(parents=True, exist_ok=True)
    WORKLOAD_FILE.write_text(compact_json(workload.model_dump(mode="json")))
    rollouts = sum(len(g.rollouts) for g in workload.groups)
    print(f"{WORKLOAD_FILE.relative_to(REPO)}: {len(workload.groups)} groups, {rollouts} rollouts, "
          f"costs {workload.costs}")


def compact_json(data: dict) -> str:
    """Top-level fields one per line, each group on one line: small diffs, small file."""
    lines = [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in data.items() if k != "groups"]
    groups = ",\n".join(f"  {json.dumps(g)}" for g in data["groups"])
    return "{\n" + ",\n".join(lines) + ',\n "groups": [\n' + groups + "\n ]\n}\n"


if __name__ == "__main__":
    main(sys.argv[1:])
