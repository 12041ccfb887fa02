"""``verbatim bench router``: the routing policies on a simulated fleet, sessions drawn from real traces.

The workload is the per-rollout length table of real ``verbatim run`` traces
(``bench/data/router_workload.json``, written by ``scripts/regen_router_workload.py``,
or ``--trace RUN_DIR``), sampled with replacement into groups that arrive as a
Poisson process. The arrival rate puts the fleet at a stated utilisation and each
replica's cache is a stated multiple of the live context it would hold under an even
spread (both from the expected session below, see :func:`plan_fleet`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from verbatim.bench import docsection
from verbatim.datamodel import Frozen
from verbatim.durable import strict_json
from verbatim.engine.routing import RouteConfig, RoutePolicy
from verbatim.errors import InputError, install_hint
from verbatim.harness.store import read_run
from verbatim.sim.simulator import CostModel, SimConfig, SimResult, simulate
from verbatim.sim.workload import TraceWorkload, fit_costs, sample_workload, shapes_from_rollouts

WORKLOAD_FILE = Path(__file__).resolve().parent / "data" / "router_workload.json"
POLICIES = tuple(p.value + suffix for p in RoutePolicy for suffix in ("", "+group"))


class FleetSettings(Frozen):
    utilisation: float = Field(default=0.7, gt=0.0)
    """Offered work over fleet capacity, with every turn prefilling only its new tokens."""
    live_sessions: float = Field(default=32.0, gt=0.0)
    """Live sessions per replica on average; sets the env's think time between turns."""
    cache: float = Field(default=1.5, gt=0.0)
    """Replica cache size as a multiple of the live context it holds under an even spread."""
    block_size: int = Field(default=16, ge=1)
    max_batch: int = Field(default=64, ge=1)


class FleetPlan(Frozen):
    group_rate_per_s: float
    kv_blocks: int
    think_s: float
    live_sessions_per_replica: float


class Row(SimResult):
    group_size: int
    kv_blocks: int
    think_s: float


def load_workload(traces: Sequence[Path]) -> TraceWorkload:
    """The committed length table, or one built from these run directories."""
    if not traces:
        return TraceWorkload.model_validate_json(WORKLOAD_FILE.read_text())
    rollouts, runs, shapes, block = [], [], [], None
    for run_dir in traces:
        trace = read_run(run_dir)
        rollouts.extend(trace.rollouts)
        shapes.extend(shapes_from_rollouts(trace.rollouts))  # per run: group ids repeat across runs
        size = trace.manifest.block_size(run_dir)  # every run must say; the first one's is kept
        block = block or size
        runs.append(_describe(trace.manifest))
    if not shapes:
        raise InputError("the traces hold no rollout with a turn", hint="pass run directories of verbatim run")
    return TraceWorkload(runs=tuple(runs), block_size=block, costs=fit_costs(rollouts),
                         groups=tuple(shapes))


def _describe(manifest: Any) -> str:
    o = manifest.config.get("options", {})
    play, sampling = o.get("play", o), o.get("sampling", o)  # a run recorded before its config had sections: flat
    engine = next((f"{k} {v}" for k, v in manifest.versions.items() if k.startswith("vllm")), "vLLM")
    return (f"`{play.get('env', '?')}`: {o.get('groups', '?')} groups × {o.get('group_size', '?')}, "
            f"≤{play.get('max_turns', '?')} turns of ≤{sampling.get('max_tokens', '?')} tokens, "
            f"{Path(manifest.model).name or '?'}, {engine}, concurrency {o.get('concurrency', '?')}")


def plan_fleet(workload: TraceWorkload, settings: FleetSettings, replicas: int, group_size: int) -> FleetPlan:
    """Arrival rate, think time and cache size for a fleet, from the expected session of ``workload``.

    Per session (groups drawn uniformly, then members): work = Σ over turns of prefill base
    + per-token × new tokens (a group's shared prompt counted once per group) + decode per
    token × (completion − 1) / max batch. The group arrival rate makes offered work =
    utilisation × fleet time. Little's law then gives the session duration that keeps
    ``live_sessions`` per replica, hence the think time (≥ 0) added to each unloaded turn, and
    the live context per replica (each session's context over its turns, time-weighted).
    """
    costs = CostModel(**workload.costs)
    weights, shapes = [], []
    for group in workload.groups:
        for shape in group.rollouts:
            weights.append(1.0 / (len(workload.groups) * len(group.rollouts)))
            shapes.append((group.shared, shape, _turn_times(shape, costs)))
    work = sum(w * _work(shared, shape, costs, settings.max_batch, group_size)
               for w, (shared, shape, _) in zip(weights, shapes))
    turns = sum(w * len(shape.completions) for w, (_, shape, _) in zip(weights, shapes))
    busy = sum(w * sum(times) for w, (_, _, times) in zip(weights, shapes))
    rate = settings.utilisation * replicas / (group_size * work)
    think = max(settings.live_sessions * work / settings.utilisation - busy, 0.0) / turns
    context = sum(w * sum((p + c) * (t + think) for p, c, t in zip(shape.prompts(), shape.completions, times))
                  for w, (_, shape, times) in zip(weights, shapes))
    live_context = rate * group_size * context / replicas
    longest = max(shape.prompts()[-1] + shape.completions[-1] for _, shape, _ in shapes)
    blocks = max(math.ceil(settings.cache * live_context / settings.block_size),
                 math.ceil(longest / settings.block_size) + 1)
    return FleetPlan(group_rate_per_s=rate, kv_blocks=blocks, think_s=think,
                     live_sessions_per_replica=rate * group_size * (busy + turns * think) / replicas)


def _work(shared: int, shape: Any, costs: CostModel, max_batch: int, group_size: int) -> float:
    prompts = shape.prompts()
    new = [prompts[0] - shared * (1 - 1 / group_size)]
    new += [p - (q + c) for p, q, c in zip(prompts[1:], prompts, shape.completions)]
    return sum(costs.prefill_base_s + costs.prefill_token_s * n + costs.decode_token_s * (c - 1) / max_batch
               for n, c in zip(new, shape.completions))


def _turn_times(shape: Any, costs: CostModel) -> list[float]:
    prompts = shape.prompts()
    new = [prompts[0]] + [p - (q + c) for p, q, c in zip(prompts[1:], prompts, shape.completions)]
    return [costs.prefill_base_s + costs.prefill_token_s * n + costs.decode_token_s * max(c - 1, 0)
            for n, c in zip(new, shape.completions)]


def run_grid(workload: TraceWorkload, replicas: Sequence[int], sessions: Sequence[int], group_sizes: Sequence[int],
             settings: FleetSettings, policies: Sequence[str] = POLICIES, seed: int = 0,
             progress: Any = None) -> list[Row]:
    costs = CostModel(**workload.costs, source="fitted to the workload's runs")
    routes = [RouteConfig.parse(p) for p in policies]
    rows = []
    for r in replicas:
        for g in group_sizes:
            plan = plan_fleet(workload, settings, r, g)
            for n in sessions:
                sim_workload = sample_workload(workload.groups, n, g, plan.group_rate_per_s, seed=seed)
                for route in routes:
                    config = SimConfig(route=route, replicas=r, kv_blocks=plan.kv_blocks,
                                       block_size=settings.block_size, max_batch=settings.max_batch, costs=costs,
                                       think_s=plan.think_s, seed=seed)
                    result = simulate(sim_workload, config)
                    rows.append(Row(**result.model_dump(), group_size=g, kv_blocks=plan.kv_blocks,
                                    think_s=plan.think_s))
                    if progress:
                        progress(rows[-1])
    return rows


def markdown(rows: Sequence[Row]) -> str:
    lines = ["| replicas | sessions | G | policy | hit rate | prefill tokens | imbalance | queue p50 s | queue p99 s | "
             "gen tok/s | migrations | tokens lost | admission wait s (mean) |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row.replicas} | {row.sessions} | {row.group_size} | {row.policy} | {row.hit_rate:.1%} | "
                     f"{row.prefill_tokens:,} | {row.imbalance:.2f} | {row.queue_p50_s:.2f} | {row.queue_p99_s:.2f} | "
                     f"{row.tokens_per_s:,.0f} | {row.migrations:,} | {row.migrated_tokens:,} | "
                     f"{row.admission_wait_mean_s:.2f} |")
    return "\n".join(lines)


def plot(rows: Sequence[Row], path: Path) -> None:
    """Hit rate against load imbalance, one marker per policy, one point per grid cell."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise InputError("the router plot needs matplotlib", hint=install_hint("report")) from exc
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    markers = "osD^v<>ph*"
    for i, policy in enumerate(dict.fromkeys(r.policy for r in rows)):
        mine = [r for r in rows if r.policy == policy]
        ax.scatter([r.imbalance for r in mine], [100 * r.hit_rate for r in mine], label=policy, s=28,
                   marker=markers[i % len(markers)], alpha=0.8)
    ax.set_xlabel("load imbalance (max / mean busy time)")
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.set_title("Routing policies, simulated fleet (one point per replicas × sessions × G)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SECTION = "bench-router"
PLOT_NAME = "bench-router.png"


def section(rows: Sequence[Row], workload: TraceWorkload, settings: FleetSettings, command: str) -> str:
    c = workload.costs
    runs = "; ".join(workload.runs) or "the committed workload"
    plans = sorted({(r.group_size, r.kv_blocks, r.think_s) for r in rows})
    caches = "; ".join(f"G={g}: {b:,} blocks ({b * settings.block_size:,} tokens)" for g, b, _ in plans)
    think = " / ".join(f"{t:.1f} s for G={g}" for g, _, t in plans)
    return "\n".join([
        markdown(rows), "",
        f"![hit rate against load imbalance per policy]({PLOT_NAME})", "",
        f"Produced by `{command}` ({time.strftime('%Y-%m-%d')}, seed fixed, deterministic). "
        f"Sessions are drawn with replacement from the turn lengths of real runs ({runs}; "
        f"{len(workload.groups)} groups, {sum(len(g.rollouts) for g in workload.groups)} rollouts). "
        f"Cost model fitted to those runs' engine timings (block size {workload.block_size}, on the machine those "
        "runs ran on, not the one below, which ran the simulation): "
        f"prefill step {c['prefill_base_s'] * 1e3:.0f} ms + {c['prefill_token_s'] * 1e3:.2f} ms per prefilled token, "
        f"decode {c['decode_token_s'] * 1e3:.0f} ms per token per running request. "
        f"Fleet: groups arrive (Poisson) at the rate that would load it to {settings.utilisation:g} if every turn "
        f"prefilled only its new tokens; block size {settings.block_size}; at most {settings.max_batch} running "
        f"requests per replica; {settings.live_sessions:g} live sessions per replica on average (mean env think "
        f"time {think}); each replica's cache {settings.cache:g} × the live context it would hold under an even "
        f"spread ({caches}).",
    ])


def write_section(doc: Path, text: str, *, machine_line: str | None = None) -> None:
    """Replace the ``bench-router`` section of ``doc``."""
    docsection.write_section(doc, SECTION, text, machine_line=machine_line)


def router_command(traces: list[Path], replicas: list[int], sessions: list[int], group_sizes: list[int], seed: int,
                   write: Path | None, as_json: bool, console: Any, *, policies: Sequence[str] = POLICIES,
                   settings: FleetSettings | None = None, machine_line: str | None = None) -> list[Row]:
    """Simulate the routing policies on a fleet of replicas with finite prefix caches.

    Sessions are drawn from real `verbatim run` traces (the committed workload, or
    --trace RUN_DIR); for each policy, with and without +group: prefix-cache hit rate,
    prefill tokens, load imbalance, p50/p99 queueing, throughput, migrations.
    --json prints one JSON object per row as it is measured; --write PATH puts the table
    into PATH's bench-router section and the plot beside PATH.
    """
    if write is not None:
        docsection.require_section(write, SECTION)
    settings = settings or FleetSettings()
    for spec in policies:
        RouteConfig.parse(spec)
    workload = load_workload(traces)
    started = time.perf_counter()

    def show(row: Row) -> None:
        if as_json:
            print(strict_json(row.model_dump(exclude={"turn_cached"})), flush=True)

    rows = run_grid(workload, replicas, sessions, group_sizes, settings, policies, seed, progress=show)
    if not as_json:
        console.print(rich_table(rows, f"router simulation ({time.perf_counter() - started:.0f} s)"))
    if write is not None:
        plot(rows, write.parent / PLOT_NAME)
        command = docsection.command_line("router", trace=[str(t) for t in traces], replicas=list(replicas),
                                          sessions=list(sessions), group_size=list(group_sizes), seed=seed,
                                          write=write)
        write_section(write, section(rows, workload, settings, command), machine_line=machine_line)
    return rows


SHORT_POLICIES = {"round_robin": "rr", "least_loaded": "ll", "session_hash": "hash",
                  "sticky_least_loaded": "sticky"}
"""The terminal table's policy names (the markdown table and --json keep the full ones)."""


def short_policy(policy: str) -> str:
    base, plus, suffix = policy.partition("+")
    return SHORT_POLICIES.get(base, base) + (plus + suffix[:1] if plus else "")


def compact(count: float) -> str:
    """``1234567`` as ``1.2M``: a count in at most 6 characters."""
    for bound, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(count) >= bound:
            scaled = count / bound
            return f"{scaled:.1f}".removesuffix(".0") + unit if scaled < 10 else f"{scaled:.0f}{unit}"
    return f"{count:.0f}"


def rich_table(rows: Sequence[Row], title: str) -> Any:
    """The rows for a terminal: readable at 80 columns (short policy names, compact counts, one fleet
    column shown once per fleet); every figure in full is in --json and the markdown table."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True, caption=(
        "fleet: replicas/sessions/G. rr round_robin, ll least_loaded, hash session_hash, sticky "
        "sticky_least_loaded, +g +group. queue and wait in s; wait: admission wait (mean)."))
    for column in ("fleet", "policy", "hit", "prefill", "imbal.", "q p50", "q p99", "tok/s", "migr.", "wait"):
        table.add_column(column, justify="left" if column in ("fleet", "policy") else "right", no_wrap=True)
    previous = None
    for r in rows:
        fleet = f"{r.replicas}/{compact(r.sessions)}/{r.group_size}"
        table.add_row(fleet if fleet != previous else "", short_policy(r.policy), f"{r.hit_rate:.1%}",
                      compact(r.prefill_tokens), f"{r.imbalance:.2f}", f"{r.queue_p50_s:.2f}",
                      f"{r.queue_p99_s:.1f}", compact(r.tokens_per_s), compact(r.migrations),
                      f"{r.admission_wait_mean_s:.2f}")
        previous = fleet
    return table
