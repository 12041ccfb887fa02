"""``verbatim bench``: benchmarks on real engines and models; results go to docs/.

Registered on the root app by :mod:`verbatim.cli.app`, which turns known errors into one
line and an exit code; this module never imports it.
"""

from __future__ import annotations

import typer

from verbatim.cli.console import console, err_console

bench_app = typer.Typer(help="Benchmarks on real engines and models; results go to docs/.",
                        no_args_is_help=True, rich_markup_mode=None)


# ---------------------------------------------------------------------------
# bench policies · rollouts · logprobs: the engine and the harness
# ---------------------------------------------------------------------------


@bench_app.command("policies")
def bench_policies(
    model: str = typer.Option("default", "--model", help="Bundled model name or Hugging Face folder."),
    write_docs: bool = typer.Option(False, "--write-docs", help="Replace the table in docs/engine.md."),
) -> None:
    """Measure the four cache policies across a real weight update (cached tokens, output change)."""
    from verbatim.bench.policy_report import run_policy_report

    table = run_policy_report(model, write_docs=write_docs)
    console.print(table)


@bench_app.command("rollouts")
def bench_rollouts(
    model: str = typer.Option("default", "--model", help="Bundled model name or Hugging Face folder."),
    write: str = typer.Option(None, "--write", help="Write the table into this markdown file (docs/benchmarks.md)."),
) -> None:
    """verbatim vs a re-rendering harness: a group sharing a long prompt, and 10-turn rollouts."""
    from pathlib import Path

    from verbatim.bench.rollouts import run_bench, write_section

    table = run_bench(model)
    console.print(table)
    if write:
        write_section(Path(write), table)


@bench_app.command("logprobs")
def bench_logprobs(
    model: str = typer.Option("default", "--model", help="Bundled model name or Hugging Face folder."),
    dtype: str = typer.Option("float32", "--dtype", help="Engine dtype: float32 or bfloat16."),
) -> None:
    """Compare the engine's sampler logprobs with transformers' fp32 logprobs of the same tokens."""
    import json

    from verbatim.bench.policy_report import logprob_agreement

    console.print(json.dumps(logprob_agreement(model, dtype)))


# ---------------------------------------------------------------------------
# bench render: bridge vs full re-render
# ---------------------------------------------------------------------------


@bench_app.command("render")
def bench_render(
    renderer: str = typer.Option("smollm2", "--renderer", help="Renderer family to time."),
    turns: str = typer.Option("10,50,200", "--turns", help="Comma-separated conversation lengths."),
    repeats: int = typer.Option(40, "--repeats", min=1, help="Timed repeats per bridge measurement."),
    write: str = typer.Option(None, "--write", help="Also write the table into this markdown file's "
                              "'## Renderers (verbatim bench render)' section (e.g. docs/benchmarks.md)."),
) -> None:
    """Per-turn time of Renderer.bridge versus a full apply_chat_template re-render."""
    import platform

    from verbatim.bench.render import bench_render as run_bench
    from verbatim.bench.render import markdown_table
    from verbatim.bench.render_report import write_section
    from verbatim.engine.models import prepare
    from verbatim.renderers.registry import get_renderer
    from verbatim.renderers.templates import resolve_template

    try:
        counts = [int(t) for t in turns.split(",") if t.strip()]
    except ValueError:
        raise typer.BadParameter(f"--turns must be comma-separated integers, got {turns!r}") from None
    chosen = get_renderer(renderer, model_dir=prepare())
    _, template = resolve_template(chosen.templates[0])
    rows = run_bench(chosen, template, counts, repeats)
    table = markdown_table(rows)
    where = f"{platform.processor() or platform.machine()}, Python {platform.python_version()}"
    console.print(f"renderer {chosen.name} ({chosen.templates[0]}), {where}")
    console.print(table)
    if write:
        write_section(write, chosen.name, chosen.templates[0], where, table)
        console.print(f"wrote {write}")


# ---------------------------------------------------------------------------
# bench router: routing policies on a simulated fleet
# ---------------------------------------------------------------------------


@bench_app.command("router")
def bench_router(
    trace: list[str] = typer.Option(None, "--trace", help="Run directory whose turn lengths to sample (repeatable; "
                                    "default: the committed table of real guess and longdoc runs)."),
    replicas: list[int] = typer.Option(None, "--replicas", help="Fleet sizes (repeatable; default 8, 16, 64)."),
    sessions: list[int] = typer.Option(None, "--sessions",
                                       help="Sessions per simulation (repeatable; default 1000, 10000)."),
    group_size: list[int] = typer.Option(None, "--group-size", help="Rollouts per group (repeatable; default 8, 16)."),
    seed: int = typer.Option(0, "--seed", help="Workload and think-time seed (same seed, same table)."),
    write: bool = typer.Option(False, "--write", help="Write the table and plot into docs/benchmarks.md."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per simulation, one per line."),
) -> None:
    """Simulate the routing policies on a fleet with finite prefix caches; sessions drawn from real traces."""
    from pathlib import Path

    from verbatim.bench.router import router_command
    from verbatim.errors import InputError

    replicas, sessions, sizes = replicas or [8, 16, 64], sessions or [1000, 10000], group_size or [8, 16]
    if min(replicas + sessions + sizes) < 1:
        raise InputError("--replicas, --sessions and --group-size must be >= 1")
    router_command([Path(t) for t in trace or []], replicas, sessions, sizes, seed, write, as_json, console)


# ---------------------------------------------------------------------------
# bench prefixflow: training-time prefix reuse versus full sequences
# ---------------------------------------------------------------------------


@bench_app.command("prefixflow")
def bench_prefixflow(
    prefix_ratio: list[float] = typer.Option(None, "--prefix-ratio",
                                             help="Shared-prefix share of each sequence, in (0, 1) "
                                                  "(repeatable; default 0.5, 0.83, 0.95)."),
    group_size: list[int] = typer.Option(None, "--group-size",
                                         help="Sequences per group (repeatable; default 4, 8, 16)."),
    seq_len: int = typer.Option(1024, "--seq-len", min=2, help="Tokens per sequence."),
    micro_batch: int = typer.Option(2, "--micro-batch", min=1,
                                    help="Sequences per baseline microbatch; PrefixFlow's phase B gets the "
                                         "same token budget."),
    repeats: int = typer.Option(1, "--repeats", min=1, help="Timed passes of each method; the fastest counts."),
    threads: int = typer.Option(None, "--threads", min=1, help="Torch intra-op threads (default: torch's)."),
    model: str = typer.Option("default", "--model", help="Bundled model name or Hugging Face folder."),
    offload: bool = typer.Option(True, "--offload/--no-offload",
                                 help="Also measure peak memory with the prefix activations offloaded to disk."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per configuration, one per line."),
) -> None:
    """Actor-side forward+backward time and peak memory: PrefixFlow versus full-sequence training."""
    import json

    from verbatim.bench.prefixflow import markdown_table, run_bench
    from verbatim.engine.models import resolve
    from verbatim.errors import InputError

    ratios = prefix_ratio or [0.5, 0.83, 0.95]
    sizes = group_size or [4, 8, 16]
    if any(not 0 < r < 1 for r in ratios) or any(g < 1 for g in sizes):
        raise InputError(f"--prefix-ratio must lie in (0, 1) and --group-size be >= 1, got {ratios} and {sizes}")

    def show(result: dict) -> None:
        if as_json:
            print(json.dumps(result), flush=True)
        else:
            err_console.print(f"r={result['prefix_ratio']} G={result['group_size']}: "
                              f"speedup {result['speedup']:.2f}x of ideal {result['ideal_speedup']:.2f}x")

    results = run_bench(resolve(model), ratios, sizes, seq_len, micro_batch, offload, repeats, threads,
                        progress=show)
    if not as_json:
        console.print(markdown_table(results))
