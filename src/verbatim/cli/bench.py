"""``verbatim bench``: benchmarks on real engines and models; ``--write PATH`` puts a table into a doc.

Every ``--write PATH`` names an existing markdown file that holds the benchmark's marked
section (``<!-- NAME:begin -->`` … ``<!-- NAME:end -->``); the file is checked before any
work starts, and the section ends with the machine the benchmark ran on, detected.

This module holds the engine's and the harness's benchmarks (policies, rollouts, logprobs, render,
router, view); the learner's are in :mod:`verbatim.cli.bench_trainer`, merged into ``bench_app``
here. Registered on the root app by :mod:`verbatim.cli.app`, which turns known errors into one
line and an exit code; this module never imports it.
"""

from __future__ import annotations

from pathlib import Path

import typer

from verbatim.bench import docsection
from verbatim.bench.docsection import command_line
from verbatim.cli.bench_trainer import trainer_benches
from verbatim.cli.console import console, err_console
from verbatim.durable import strict_json

bench_app = typer.Typer(help="Benchmarks on real engines and models; --write PATH puts a table into a doc.",
                        no_args_is_help=True, rich_markup_mode=None)


# ---------------------------------------------------------------------------
# bench policies · rollouts · logprobs: the engine and the harness
# ---------------------------------------------------------------------------


@bench_app.command("policies")
def bench_policies(
    model: str = typer.Option("default", "--model", help="Bundled model name or Hugging Face folder."),
    write: Path = typer.Option(None, "--write", help="Also write the table into this markdown file's "
                               "policy-table section (docs/engine.md)."),
) -> None:
    """Measure the four cache policies across a real weight update (cached tokens, output change)."""
    from verbatim.bench.policy_report import POLICY_SECTION, run_policy_report

    if write is not None:
        docsection.require_section(write, POLICY_SECTION)
    table = run_policy_report(model, write=write)
    console.print(table)


@bench_app.command("rollouts")
def bench_rollouts(
    model: str = typer.Option("default", "--model", help="Bundled model name or Hugging Face folder."),
    write: Path = typer.Option(None, "--write", help="Also write the table into this markdown file's "
                               "bench-rollouts section (docs/benchmarks.md)."),
    repeats: int = typer.Option(1, "--repeats", min=1, help="Timed passes of each harness per workload, in "
                                "turn; the fastest counts."),
) -> None:
    """verbatim vs a re-rendering harness: a group sharing a long prompt, and 10-turn rollouts."""
    from verbatim.bench.rollouts import SECTION, run_bench, write_section

    if write is not None:
        docsection.require_section(write, SECTION)
    with err_console.status("bench rollouts…") as status:
        table = run_bench(model, command_line("rollouts", model=model, repeats=repeats if repeats > 1 else None,
                                              write=write),
                          say=lambda text: status.update(f"bench rollouts: {text}"), repeats=repeats)
    console.print(table)
    if write is not None:
        write_section(write, table)


@bench_app.command("logprobs")
def bench_logprobs(
    model: str = typer.Option("default", "--model", help="Bundled model name or Hugging Face folder."),
    dtype: list[str] = typer.Option(None, "--dtype", help="Engine dtype: float32 or bfloat16 (repeatable, one "
                                    "engine each; default float32)."),
    write: Path = typer.Option(None, "--write", help="Also write a table of every dtype into this markdown "
                               "file's bench-logprobs section (docs/engine.md)."),
) -> None:
    """Compare the engine's sampler logprobs with transformers' fp32 logprobs of the same tokens."""
    from verbatim.bench.policy_report import LOGPROB_SECTION, agreement_table, logprob_agreement, write_agreement
    from verbatim.engine.models import resolve

    dtypes = dtype or ["float32"]
    if write is not None:
        docsection.require_section(write, LOGPROB_SECTION)
    results = []
    for name in dtypes:
        results.append(logprob_agreement(model, name))
        console.print(strict_json(results[-1]))
    if write is not None:
        command = command_line("logprobs", model=model, dtype=dtypes, write=write)
        write_agreement(write, agreement_table(results, resolve(model).name, command))


# ---------------------------------------------------------------------------
# bench render: bridge vs full re-render
# ---------------------------------------------------------------------------


@bench_app.command("render")
def bench_render(
    renderer: str = typer.Option("smollm2", "--renderer", help="Renderer family to time."),
    turns: str = typer.Option("10,50,200", "--turns", help="Comma-separated conversation lengths."),
    repeats: int = typer.Option(40, "--repeats", min=1, help="Timed repeats per bridge measurement."),
    write: Path = typer.Option(None, "--write", help="Also write the table into this markdown file's "
                               "bench-render section (docs/benchmarks.md)."),
) -> None:
    """Per-turn time of Renderer.bridge versus a full apply_chat_template re-render."""
    from verbatim.bench import machine
    from verbatim.bench.render import bench_render as run_bench
    from verbatim.bench.render import markdown_table
    from verbatim.bench.render_report import LIBRARIES, SECTION, write_section
    from verbatim.engine.models import prepare
    from verbatim.renderers.registry import get_renderer
    from verbatim.renderers.templates import resolve_template

    try:
        counts = [int(t) for t in turns.split(",") if t.strip()]
    except ValueError:
        raise typer.BadParameter(f"--turns must be comma-separated integers, got {turns!r}") from None
    if write is not None:
        docsection.require_section(write, SECTION)
    chosen = get_renderer(renderer, model_dir=prepare())
    _, template = resolve_template(chosen.templates[0])
    rows = run_bench(chosen, template, counts, repeats)
    table = markdown_table(rows)
    console.print(f"renderer {chosen.name} ({chosen.templates[0]}), {machine.describe(machine.detect(LIBRARIES))}")
    console.print(table)
    if write is not None:
        command = command_line("render", renderer=renderer, turns=turns, repeats=repeats, write=write)
        write_section(write, chosen.name, chosen.templates[0], command, table)
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
    write: Path = typer.Option(None, "--write", help="Also write the table into this markdown file's bench-router "
                               "section (docs/benchmarks.md) and the plot beside it."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per simulation, one per line."),
) -> None:
    """Simulate the routing policies on a fleet with finite prefix caches; sessions drawn from real traces."""
    from verbatim.bench.router import router_command
    from verbatim.errors import InputError

    replicas, sessions, sizes = replicas or [8, 16, 64], sessions or [1000, 10000], group_size or [8, 16]
    if min(replicas + sessions + sizes) < 1:
        raise InputError("--replicas, --sessions and --group-size must be >= 1")
    router_command([Path(t) for t in trace or []], replicas, sessions, sizes, seed, write, as_json, console)


bench_app.add_typer(trainer_benches)  # the learner's benchmarks (cli/bench_trainer.py), listed after these


# ---------------------------------------------------------------------------
# bench view: how fast `verbatim view` opens a large run
# ---------------------------------------------------------------------------


@bench_app.command("view")
def bench_view(
    rollouts: int = typer.Option(10_000, "--rollouts", min=1, help="Rollouts in the synthetic run."),
    turns: int = typer.Option(3, "--turns", min=1, help="Turns per rollout."),
    long_tokens: int = typer.Option(30_000, "--long-tokens", min=1_000, help="Tokens of the one long rollout."),
    write: Path = typer.Option(None, "--write", help="Also write the table into this markdown file's bench-view "
                               "section (docs/benchmarks.md)."),
) -> None:
    """Time verbatim view on a synthetic run written to a temporary folder: the first page, one long rollout,
    the background lint."""
    from verbatim.engine import models
    from verbatim.view.bench import LIBRARIES, SECTION, markdown, run_bench

    if write is not None:
        docsection.require_section(write, SECTION)
    model = str(models.prepared_path(models.DEFAULT_MODEL)) if models.is_prepared(models.DEFAULT_MODEL) else ""
    result = run_bench(rollouts, turns=turns, long_tokens=long_tokens, model=model)
    command = command_line("view", rollouts=None if rollouts == 10_000 else rollouts,
                           turns=None if turns == 3 else turns,
                           long_tokens=None if long_tokens == 30_000 else long_tokens, write=write)
    text = markdown(result, command)
    console.print(text, markup=False, highlight=False)
    if write is not None:
        docsection.write_section(write, SECTION, text, libraries=LIBRARIES)
        console.print(f"wrote {write}")
