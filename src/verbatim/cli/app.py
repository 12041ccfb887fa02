"""The ``verbatim`` command line (a Typer app).

Known errors (:class:`verbatim.errors.VerbatimError`) and usage errors print as
one line on stderr; exit code 2 means bad input, 1 a failure. ``--debug`` shows
the traceback instead. No flag of any command takes a non-finite number (inf, -inf,
nan), from the command line or a ``--config`` file: refused as bad input, naming it.
"""

from __future__ import annotations

import errno
import gc
import math
import sys
from collections.abc import Callable
from typing import Any

import typer
import typer.core
from pydantic import ValidationError
from rich.table import Table

from verbatim import __version__
from verbatim.cli.bench import bench_app
from verbatim.cli.console import console, err_console
from verbatim.cli.diff import diff_command
from verbatim.cli.job_flags import SectionedHelp, job_command
from verbatim.cli.lint import lint_app, mismatch_report
from verbatim.cli.models import models_app
from verbatim.cli.plot import plot_command
from verbatim.cli.serve import fleet_app, serve_command
from verbatim.cli.show import show_command
from verbatim.cli.view import view_command
from verbatim.engine.runtime import DEFAULT_MAX_MODEL_LEN, MAX_SEED
from verbatim.errors import VerbatimError, shorten, stacks_on_request
from verbatim.jobs.config import EVAL_FLAGS, RUN_FLAGS, TRAIN_FLAGS

try:  # typer >= 0.24 vendors click as typer._click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older typer on plain click
    from click import exceptions as click_errors  # type: ignore[no-redef]


def _validation_line(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"invalid {exc.title} setting{' ' + where if where else ''}: {message}"


class _OneLineErrors(typer.core.TyperGroup):
    """Runs the app and turns every known error into one line and an exit code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _refuse_non_finite(self)

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        debug = "--debug" in argv
        if debug:  # --debug works anywhere on the line: it is the app's option, so it goes first
            argv = ["--debug", *(a for a in argv if a != "--debug")]
        try:
            result = super().main(args=argv, prog_name="verbatim",
                                  complete_var=complete_var, standalone_mode=False, **extra)
            # without standalone mode click hands back typer.Exit's code instead of raising it
            code = result if isinstance(result, int) else 0
        except typer.Exit as exc:
            code = exc.exit_code
        except click_errors.NoArgsIsHelpError as exc:
            console.print(exc.format_message())
            code = 0
        except click_errors.ClickException as exc:  # usage errors: bad option, missing argument…
            if debug:
                raise
            where = f" (see '{exc.ctx.command_path} --help')" if getattr(exc, "ctx", None) else ""
            code = _error(f"{' '.join(exc.format_message().split())}{where}",
                          2 if isinstance(exc, click_errors.UsageError) else exc.exit_code)
        except typer.Abort:
            code = _error("aborted", 130)
        except VerbatimError as exc:
            if debug:
                raise
            code = _error(exc.one_line(), exc.exit_code)
        except ValidationError as exc:  # options that pass the parser but not a settings model
            if debug:
                raise
            code = _error(_validation_line(exc), 2)
        except OSError as exc:  # a path the system refuses (too long, not a folder, no permission…)
            if debug:
                raise
            code = _error(_os_line(exc), 2 if exc.errno in _BAD_PATH else 1)
        except KeyboardInterrupt:
            code = _error("interrupted", 130)
        if standalone_mode:
            sys.exit(code)
        return code


def _refuse_non_finite(command: Any) -> None:
    """Every parameter of ``command`` and of its subcommands, at any depth, refuses a non-finite float:
    its callback runs on the value the command line gives and on a ``--config`` file's alike."""
    for sub in getattr(command, "commands", {}).values():
        _refuse_non_finite(sub)
    for param in command.params:
        param.callback = _finite_then(param.callback)


def _finite_then(callback: Callable[..., Any] | None) -> Callable[..., Any]:
    """A parameter callback: a value (or an item of a repeated flag's) that is inf, -inf or nan is a bad
    parameter; any other goes on to ``callback``."""

    def check(ctx: Any, param: Any, value: Any) -> Any:
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, float) and not math.isfinite(item):
                raise typer.BadParameter(f"{item} is not a finite number", ctx=ctx, param=param)
        return value if callback is None else callback(ctx, param, value)

    return check


_BAD_PATH = {errno.ENAMETOOLONG, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EROFS,
             errno.EEXIST, errno.ELOOP}


def _os_line(exc: OSError) -> str:
    what = exc.strerror or type(exc).__name__
    return f"{what}: {exc.filename}" if exc.filename is not None else f"{what}: {exc}"


def _error(line: str, code: int) -> int:
    """One line on stderr, every over-long word in it (a pasted file, a 100 kB URL) cut short."""
    err_console.print(f"error: {shorten(line)}", markup=False)  # a message may hold brackets (paths, gloo)
    return code


app = typer.Typer(
    cls=_OneLineErrors,
    help="verbatim: token-exact multi-turn rollouts for RL on LLM agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
app.add_typer(models_app, name="models")
app.add_typer(lint_app, name="lint")
app.add_typer(bench_app, name="bench")
app.add_typer(fleet_app, name="fleet")


def _version(value: bool) -> None:
    if value:
        console.print(f"verbatim {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors."),
) -> None:
    """verbatim: token-exact multi-turn rollouts for RL on LLM agents."""


# ---------------------------------------------------------------------------
# generate: one real single-turn generation from token IDs
# ---------------------------------------------------------------------------


@app.command("generate")
def generate(
    prompt: str = typer.Option("What is 2+2? Answer in one sentence.", "--prompt", "-p",
                               help="User message, rendered once with the model's chat template."),
    model: str = typer.Option("default", "--model", help="Bundled model name or Hugging Face folder."),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1, help="Tokens to sample."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 means greedy."),
    seed: int = typer.Option(0, "--seed", min=0, max=MAX_SEED, help="Sampling seed."),
    max_model_len: int = typer.Option(DEFAULT_MAX_MODEL_LEN, "--max-model-len", min=64,
                                      help="Context length per request: prompt + sampled tokens."),
) -> None:
    """Sample one completion from token IDs on the bundled vLLM engine; print tokens and logprobs."""
    from pathlib import Path

    from verbatim.engine.generate import generate_once
    from verbatim.renderers.detect import folder_template

    if Path(model).expanduser().is_dir():  # a folder without a chat template: one line before anything loads
        folder_template(Path(model).expanduser())
    result = generate_once(model, prompt, max_tokens=max_tokens, temperature=temperature, seed=seed,
                           max_model_len=max_model_len)
    table = Table(title=f"{len(result.completion.token_ids)} sampled tokens "
                        f"(prompt {result.completion.prompt_tokens} tokens)")
    for column in ("#", "token id", "text", "logprob", "version"):
        table.add_column(column, justify="right" if column != "text" else "left")
    c = result.completion
    for i, (tid, piece, lp, ver) in enumerate(zip(c.token_ids, result.pieces, c.logprobs, c.versions)):
        table.add_row(str(i), str(int(tid)), repr(piece), f"{float(lp):.4f}", str(int(ver)))
    console.print(table)
    console.print(f"text: {result.text!r}")
    console.print(f"finish: {c.finish_reason}  sum logprob: {float(c.logprobs.sum()):.4f}  "
                  f"engine: vLLM {result.engine_version}  total {c.total_s:.2f}s")


# ---------------------------------------------------------------------------
# run: the main job
# ---------------------------------------------------------------------------


def _run(options: Any, summary_json: str | None, force: bool) -> None:
    from verbatim.cli.run import run_command

    run_command(options, console, summary_json, replace=force)


def _eval(options: Any, summary_json: str | None, force: bool) -> None:
    from verbatim.cli.evaluate import eval_command

    eval_command(options, console, summary_json, replace=force)


def _train(options: Any, summary_json: str | None, force: bool) -> None:
    from verbatim.cli.train import train_command

    train_command(options, console, summary_json, replace=force)


RUN_EXAMPLE = ("A first run: verbatim run --env guess --groups 2 --group-size 4 --out runs/first; then verbatim show "
               "runs/first, verbatim lint trace runs/first, verbatim view runs/first.")
TRAIN_EXAMPLE = ("A first training run: verbatim train --env guess --env-arg high=5 --steps 6 --groups 4 "
                 "--group-size 8 --out runs/first-train; then verbatim plot runs/first-train. docs/trainer.md says "
                 "more.")
app.command("run", epilog=RUN_EXAMPLE, cls=SectionedHelp)(job_command(
    RUN_FLAGS, _run, "Play groups of multi-turn rollouts on the engine; write a token-exact trace and print a "
                     "summary."))
EVAL_EXAMPLE = ("Evaluate a training run's newest checkpoint on 8 held-out guess games, 4 samples each: verbatim eval "
                "--env guess --env-arg high=5 --model runs/first-train --out runs/first-eval; then verbatim show "
                "runs/first-eval.")
app.command("eval", epilog=EVAL_EXAMPLE, cls=SectionedHelp)(job_command(
    EVAL_FLAGS, _eval, "Evaluate a model or a training run's checkpoint on held-out tasks, K samples each: avg@K, "
                       "success rate and pass@k, per task and overall, from a token-exact trace."))
app.command("train", epilog=TRAIN_EXAMPLE, cls=SectionedHelp)(job_command(
    TRAIN_FLAGS, _train, "Train the model with RL on its own token-exact rollouts: play, learn, push weights, "
                         "repeat."))


# ---------------------------------------------------------------------------
# export: trainer-ready files
# ---------------------------------------------------------------------------


@app.command("export")
def export(
    run_dir: str = typer.Argument(..., help="A run directory written by 'verbatim run'."),
    fmt: str = typer.Option(..., "--format", help="parquet | jsonl (the native trace) | verl | trl | prime."),
    out: str = typer.Option(None, "--out", help="Output file or folder outside the run (default: "
                                                "RUN_DIR/exports/FORMAT.*)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output file."),
) -> None:
    """Write a run's rollouts as one trainer-ready file (schemas in docs/traces.md)."""
    from verbatim.harness.export import default_out, export_path, export_rollouts, parse_format
    from verbatim.harness.store import read_run

    fmt = parse_format(fmt)
    export_path(fmt, out or default_out(run_dir, fmt), force=force)  # refused before the run is read
    trace = read_run(run_dir)
    for problem in trace.problems:
        err_console.print(f"warning: {problem}")
    result = export_rollouts(trace.rollouts, fmt, out or default_out(run_dir, fmt), force=force)
    console.print(result.line(), soft_wrap=True, markup=False, highlight=False)


@app.command("export-model")
def export_model_command(
    source: str = typer.Argument(..., help="A training run's folder (its newest complete checkpoint) or one "
                                           "checkpoint, RUN_DIR/checkpoints/step-N."),
    out: str = typer.Option(..., "--out", help="The model folder to write (missing or empty)."),
    merge: bool = typer.Option(False, "--merge", help="A LoRA run's adapter folded into its base model: a Hugging "
                                                      "Face folder that loads without peft."),
    force: bool = typer.Option(False, "--force", help="Replace what --out holds."),
) -> None:
    """Write a training run's model as a folder of its own: a whole model's Hugging Face folder, a LoRA run's PEFT
    adapter folder, or with --merge the base model with the adapter folded in."""
    from verbatim.jobs.export_model import export_model

    console.print(str(export_model(source, out, merge=merge, force=force)), soft_wrap=True, markup=False,
                  highlight=False)


# mismatch lives in cli/lint.py beside 'lint trace': both check what a run recorded.
app.command("mismatch")(mismatch_report)
# plot draws a training run's metrics.jsonl (cli/plot.py).
app.command("plot")(plot_command)
# show prints one rollout's text turn by turn (cli/show.py).
app.command("show")(show_command)
# diff says whether two runs are the same and where they first part (cli/diff.py, harness/run_diff.py).
app.command("diff")(diff_command)

# view serves a local page of a run directory (cli/view.py, verbatim/view/).
app.command("view")(view_command)


# serve runs one vLLM server, fleet up/down several (cli/serve.py).
app.command("serve")(serve_command)


def main() -> None:
    """Console-script entry point (``kill -USR1`` of it prints every thread's stack on stderr)."""
    stacks_on_request()
    try:
        app()
    finally:
        gc.collect()  # objects in cycles (a sharded learner and its process groups) end before the interpreter does

