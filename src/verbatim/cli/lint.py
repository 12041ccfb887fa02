"""``verbatim lint`` and ``verbatim mismatch``: can a trainer trust a template or a run?

``lint template`` checks a chat template for token drift, ``lint trace`` checks a run's
rollouts, and ``mismatch`` compares the sampler's logprobs with the trainer's. Registered
on the root app by :mod:`verbatim.cli.app`, which turns known errors into one line and an
exit code; this module never imports it.
"""

from __future__ import annotations

import sys
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from verbatim.cli.console import console, err_console
from verbatim.durable import strict_json

lint_app = typer.Typer(help="Check chat templates and traces for token drift.", no_args_is_help=True,
                       rich_markup_mode=None)


# ---------------------------------------------------------------------------
# lint template: chat-template drift
# ---------------------------------------------------------------------------


@lint_app.command("template")
def lint_template(
    template: str = typer.Option(..., "--template", help="A .jinja file, an official template name "
                                 "(qwen3, gpt_oss…) or a renderer name (llama3…)."),
    tokenizer: str = typer.Option(None, "--tokenizer", help="Tokenizer folder/tokenizer.json or renderer "
                                  "name (default: the default model's)."),
    conversations: str = typer.Option(None, "--conversations", help="JSONL of {\"messages\": [...], "
                                      "\"tools\": [...]} objects (default: the built-in set)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per conversation on stdout."),
    variables: list[str] = typer.Option(None, "--var", help="Pin a template variable, KEY=VALUE (repeatable); "
                                        "VALUE is read as JSON when it parses (true, 3, [...]), else as text."),
    pin_defaults: bool = typer.Option(True, "--pin-defaults/--no-pin-defaults", help="Pin date_string "
                                      "(\"26 Jul 2024\") for templates that read it, as the renderers do."),
) -> None:
    """Does re-rendering history with this template change tokens already rendered, or drop tool calls? Exit 1 if so."""

    from verbatim.renderers import drift
    from verbatim.renderers.conversations import DEFAULT_CONVERSATIONS, load_conversations
    from verbatim.renderers.templates import resolve_template, resolve_tokenizer

    pins = parse_variables(variables or [])
    label, text = resolve_template(template)
    chats = load_conversations(conversations or DEFAULT_CONVERSATIONS)
    model_dir = None
    if tokenizer is None or not _is_path(tokenizer):
        from verbatim.engine.models import prepare

        model_dir = prepare()
    if tokenizer is None:
        from verbatim.renderers.tokenizers import smollm2_tokenizer

        tok = smollm2_tokenizer(str(model_dir))
    else:
        tok = resolve_tokenizer(tokenizer, model_dir)
    renderer = drift.TemplateRenderer(text, tok, pin_defaults=pin_defaults, **pins)
    verdicts = drift.lint(renderer, chats)
    if as_json:
        for verdict in verdicts:
            print(strict_json(verdict.as_json(), ensure_ascii=False))
    else:
        console.print(_drift_table(label, verdicts, renderer.variables))
    for verdict in verdicts:
        if verdict.problem is not None:
            err_console.print(f"warning: {verdict.problem}", markup=False, highlight=False)
    refused = drift.nothing_linted(verdicts)
    if refused:
        err_console.print(f"error: {label}: {refused} (check the template, or pass --conversations it accepts)",
                          markup=False, highlight=False)
    # sys.exit, not typer.Exit: the group runs click with standalone_mode=False, where an Exit's code
    # comes back as a return value and would be lost.
    sys.exit(drift.exit_code(verdicts))


# ---------------------------------------------------------------------------
# lint trace: can a trainer trust this run?
# ---------------------------------------------------------------------------


@lint_app.command("trace")
def lint_trace(
    run_dir: str = typer.Argument(..., help="A run directory written by 'verbatim run'."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per rollout (and damaged file) on stdout."),
    groups: bool = typer.Option(False, "--groups", help="Also check each group's shared prompt was prefilled "
                                "once (not for resumed runs)."),
    tokens_only: bool = typer.Option(False, "--tokens-only", help="Judge only the rollouts written: exit 0 for a "
                                     "killed, stopped or failed run whose written rollouts are clean."),
) -> None:
    """Check every rollout (exact prefix extension, logprobs, versions, prefix-cache hits) and that the run is
    whole (manifest status, planned vs written rollouts). Exit 1 if wrong or incomplete."""

    from verbatim.lint.report import report_table
    from verbatim.lint.trace import lint_run

    report = lint_run(run_dir, groups=groups)
    if as_json:
        for verdict in report.verdicts:
            print(strict_json(verdict.as_json(), ensure_ascii=False))
        print(strict_json(report.run.as_json(), ensure_ascii=False))
    else:
        console.print(report_table(run_dir, report))
    raise typer.Exit(report.exit_code(tokens_only))


def parse_variables(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings as template variables; a VALUE that parses as JSON is that value, else text."""
    import json

    from verbatim.errors import InputError

    pins: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise InputError(f"--var {item!r} is not KEY=VALUE", hint='e.g. --var date_string="26 Jul 2024"')
        try:
            pins[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            pins[key.strip()] = value
    return pins


def _is_path(value: str) -> bool:
    from pathlib import Path

    return Path(value).expanduser().exists()


def _drift_table(label: str, verdicts: Any, pins: dict[str, Any]) -> Table:
    def count(attribute: str) -> int:
        return sum(getattr(v, attribute) is True for v in verdicts)

    dropped = sum(v.tool_calls_kept is False for v in verdicts)
    table = Table(title=f"{label}: {count('prefix_stable')}/{len(verdicts)} conversations prefix-stable "
                        f"(history {count('history_stable')}, generation prompt {count('generation_prompt_stable')})"
                        + (f"; tool calls dropped in {dropped}" if dropped else ""))
    for column in ("#", "stable", "kind", "cut", "diff at", "cause", "miss", "earlier | later tokens"):
        table.add_column(column)
    if pins:
        table.caption = "pinned: " + ", ".join(f"{key}={value!r}" for key, value in pins.items())
    for verdict in verdicts:
        number = str(verdict.conversation)
        if verdict.unsupported is not None:
            table.add_row(number, "n/a", "", "", "", escape(f"refused: {verdict.unsupported}"), "", "")
        elif verdict.problem is not None:
            table.add_row(number, "n/a", "", "", "", escape(f"problem: {verdict.problem}"), "", "")
        elif not verdict.violations:
            table.add_row(number, "yes", "", "", "", "", "", "")
        for v in verdict.violations:
            context = escape(f"{''.join(v.earlier)!r} | {''.join(v.later)!r}")  # tokens like [/INST] are text
            stable = "yes" if verdict.prefix_stable else "no"  # a dropped tool call is not a prefix drift
            table.add_row(number, stable, v.kind, f"{v.cut[0]}-{v.cut[1]}", str(v.first_divergence), v.cause,
                          str(v.miss_tokens), context)
    return table


# ---------------------------------------------------------------------------
# mismatch: sampler logprobs (μ) versus the trainer's (π); a root command
# ---------------------------------------------------------------------------


def mismatch_report(
    run_dir: str = typer.Argument(..., help="A run directory written by 'verbatim run'."),
    model: str = typer.Option(None, "--model", help="Weights to recompute π with (name or HF folder). Default: "
                              "the run's weights of --trainer-version (a training run's checkpoint, or its "
                              "base model for version 0 and for a 'verbatim run' run)."),
    trainer_version: int = typer.Option(None, "--trainer-version", help="The policy version π stands for (lag = it "
                                        "minus each token's version). Default: the newest version in the trace."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    plot: str = typer.Option(None, "--plot", help="Write a histogram of log π − log μ to this PNG."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --plot file."),
    save: bool = typer.Option(False, "--save", help="Also write each rollout's log π and the correction's keep mask "
                              "to RUN_DIR/trainer_logprobs.parquet (verbatim view colours tokens by them)."),
) -> None:
    """Recompute π for every model token of a trace and report how it differs from the sampler's μ."""
    from pathlib import Path

    from verbatim.harness.store import read_run
    from verbatim.paths import check_output_file, check_outside_run
    from verbatim.rl.run_weights import policy_weights
    from verbatim.trainer.logprob_files import mismatch_file
    from verbatim.trainer.mismatch import check_vocabulary, mismatch, plot_histogram, save_logprobs, usable_rollouts
    from verbatim.trainer.reference import load_model

    if plot:
        check_outside_run(plot, "--plot")  # before the minutes of computing, not after
        check_output_file(plot, "--plot", existing_ok=force)
    trace = read_run(run_dir)
    for problem in trace.problems:
        err_console.print(f"warning: {problem}")
    rollouts = usable_rollouts(trace.rollouts)
    weights = policy_weights(run_dir, rollouts, trainer_version, model)
    model_dir = weights.folder
    network = load_model(model_dir)
    check_vocabulary(rollouts, int(network.config.vocab_size), model_dir.name)
    report = mismatch(rollouts, network, trainer_version=weights.version)
    if plot:
        plot_histogram(report, Path(plot))
    if save:
        saved = save_logprobs(report, mismatch_file(run_dir), str(model_dir))
        err_console.print(f"wrote {saved}", markup=False, highlight=False)
    if as_json:
        shown = report.as_dict() | {"weights": str(model_dir), "weights_source": weights.source}
        console.print_json(strict_json(shown))
        return
    console.print(_mismatch_table(report, weights.source))
    if report.routing is not None:
        console.print(_routing_line(report.routing))


def _routing_line(routing: dict[str, Any]) -> str:
    """The routing replay's part of the report (a trace with routed experts, a MoE model)."""
    first = routing["flipped_tokens"][:5]
    shown = ", ".join(f"{row} token {at} ({layers} layer{'s' if layers > 1 else ''})" for row, at, layers in first)
    return (f"routing: the model's own router sends {routing['flip_rate']:.2%} of "
            f"{routing['token_layers']} token-layers elsewhere than the engine did ({routing['tokens_with_flips']} "
            f"tokens{': ' + shown if shown else ''}); with the engine's experts replayed, mean |log π − log μ| = "
            f"{routing['mean_abs_log_ratio_replayed']:.2e}")


def _mismatch_table(report: Any, weights: str) -> Table:
    overall = report.metrics["all"]
    table = Table(title=f"sampler vs trainer: {report.model_tokens} model tokens, {report.rollouts} rollouts, "
                        f"trainer version {report.trainer_version} (π from {weights})")
    table.add_column("slice", no_wrap=True)
    table.add_column("tokens", justify="right")
    table.add_column("mean |log π − log μ|", justify="right")
    table.add_column("ratio p01 / p50 / p99", justify="right")
    table.add_column("masked (any rule)", justify="right")
    table.add_column("k3 KL", justify="right")

    def row(name: str, stats: dict) -> None:
        q = stats["ratio_quantiles"]
        quantiles = f"{q['p01']:.5f} / {q['p50']:.5f} / {q['p99']:.5f}" if q else "-"
        mean = stats["mean_abs_log_ratio"]
        k3 = stats["k3"]
        table.add_row(name, str(stats["tokens"]), "-" if mean is None else f"{mean:.2e}", quantiles,
                      f"{stats['dropped'].get('any', 0.0):.2%}", "-" if k3 is None else f"{k3:.2e}")

    row("all", overall)
    for lag, stats in sorted(report.metrics["by_lag"].items(), key=lambda kv: int(kv[0])):
        row(f"lag {lag}", stats)
    if (report.metrics.get("hybrid") or {}).get("tokens"):
        row("hybrid", report.metrics["hybrid"])
    rules = ", ".join(f"{k} {v:.2%}" for k, v in overall["dropped"].items() if k != "any")
    table.caption = (f"masked per rule: {rules}. lag = trainer version − sampling version; "
                     "hybrid = sampled just after a weight update inside its sequence")
    return table
