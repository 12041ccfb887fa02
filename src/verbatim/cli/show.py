"""``verbatim show RUN [ROLLOUT]``: read a rollout in the terminal, turn by turn.

Without ROLLOUT it lists the run's rollouts and shows the first. Text is decoded with the
tokenizer of the renderer the run's manifest records (and its model folder); where that
cannot be loaded the token ids are shown instead, with the reason. Registered on the root
app by :mod:`verbatim.cli.app`, which turns known errors into one line and an exit code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from verbatim.cli.console import console, err_console
from verbatim.datamodel import Rollout, Source
from verbatim.errors import InputError
from verbatim.harness.transcript import Part, ending, parts, solved

Decode = Callable[[Sequence[int]], str]

STYLES = {Source.PROMPT: "dim", Source.ENV: "cyan", Source.MODEL: "green"}


def show_command(
    run_dir: str = typer.Argument(..., help="A run directory written by 'verbatim run' or 'verbatim train'."),
    rollout: str = typer.Argument(None, help="Rollout id to show (default: list the rollouts, show the first)."),
    ids: bool = typer.Option(False, "--ids", help="Show token ids instead of decoded text."),
) -> None:
    """Show a rollout's text turn by turn: who wrote each part, logprobs, policy versions, why it ended."""
    from verbatim.harness.store import read_run

    trace = read_run(run_dir)
    for problem in trace.problems:
        err_console.print(f"warning: {problem}", markup=False, highlight=False)
    if not trace.rollouts:
        raise InputError(f"{run_dir} holds no rollouts yet")
    rollouts = sorted(trace.rollouts, key=lambda r: r.rollout_id)  # by id, not in the order they finished
    if rollout is None:
        console.print(rollout_list(rollouts, run_dir))
        chosen = rollouts[0]
    else:
        chosen = find_rollout(rollouts, rollout, run_dir)
    decode, why = (None, "--ids") if ids else load_decoder(trace.manifest)
    if decode is None and not ids:
        console.print(Text(f"token ids shown: the tokenizer could not be loaded ({why})", style="yellow"))
    for line in transcript(chosen, decode):
        console.print(line)


def find_rollout(rollouts: Sequence[Rollout], rollout_id: str, run_dir: str) -> Rollout:
    for rollout in rollouts:
        if rollout.rollout_id == rollout_id:
            return rollout
    known = ", ".join(r.rollout_id for r in rollouts[:3]) + (", …" if len(rollouts) > 3 else "")
    raise InputError(f"{run_dir} has no rollout {rollout_id!r}",
                     hint=f"its ids: {known} (all of them: verbatim show {run_dir})")


def load_decoder(manifest: Any) -> tuple[Decode | None, str | None]:
    """Token ids → text with the run's renderer's tokenizer, or None and why it could not be loaded."""
    try:
        from verbatim.engine.models import resolve
        from verbatim.renderers.registry import get_renderer

        model_dir = resolve(manifest.model) if manifest.model else None
        tokenizer = get_renderer(manifest.renderer, model_dir=model_dir).tokenizer
    except Exception as exc:  # noqa: BLE001 - any failure falls back to showing token ids
        reason = exc.one_line() if hasattr(exc, "one_line") else f"{type(exc).__name__}: {exc}"
        return None, " ".join(reason.split())
    return (lambda token_ids: tokenizer.decode(list(token_ids), skip_special_tokens=False)), None


def rollout_list(rollouts: Sequence[Rollout], run_dir: str) -> Table:
    table = Table(title=f"{len(rollouts)} rollouts of {run_dir}")
    for column in ("id", "group", "status", "reward", "solved", "turns"):
        table.add_column(column, justify="right" if column in ("reward", "turns") else "left")
    for r in rollouts:
        said = solved(r)
        table.add_row(r.rollout_id, r.group_id, r.status, "-" if r.reward is None else f"{r.reward:g}",
                      "-" if said is None else ("yes" if said else "no"), str(len(r.turns)))
    table.caption = "showing the first; pass an id to see another: verbatim show RUN ID"
    return table


def transcript(rollout: Rollout, decode: Decode | None) -> list[Text]:
    """The rollout's heading, each part's heading and text, and how it ended."""
    lines = [Text(f"rollout {rollout.rollout_id} · group {rollout.group_id}", style="bold")]
    opens = {turn.prompt_start: turn.index for turn in rollout.turns if turn.prompt_start}
    breaks = {b.get("start"): b for b in rollout.info.get("segments") or () if isinstance(b, dict)}
    for part in parts(rollout):
        if part.source is Source.PROMPT and part.start in opens:
            what = (breaks.get(part.start) or {}).get("what", "the trace does not say what changed")
            lines.append(Text(f"══ history break before turn {opens[part.start]}: the agent rewrote its history "
                              f"({what}); a new segment starts here", style="bold yellow"))
        lines.append(Text(part_heading(part), style=f"bold {STYLES.get(part.source, 'red')}"))
        body = decode(part.token_ids) if decode is not None else " ".join(map(str, part.token_ids))
        lines.append(Text(body, style=STYLES.get(part.source, "red")))
    lines.append(ending_line(ending(rollout)))
    return lines


def part_heading(part: Part) -> str:
    words = [f"turn {part.turn.index}" if part.turn is not None else None, part.label,
             f"tokens {part.start}–{part.end - 1} ({part.end - part.start})"]
    if part.source is Source.MODEL:
        words.append(part.logprob_summary())
        words.append("version " + ",".join(map(str, part.versions)) if part.versions else None)
        if part.turn is not None:
            words += [f"finish {part.turn.finish_reason}", f"cached {part.turn.cached_tokens}",
                      None if part.turn.reward is None else f"reward {part.turn.reward:g}"]
    return "── " + " · ".join(w for w in words if w)


def ending_line(end: dict[str, Any]) -> Text:
    said = {None: "", True: " · solved", False: " · not solved"}[end["solved"]]
    reward = "-" if end["reward"] is None else f"{end['reward']:g}"
    versions = ",".join(map(str, end["versions"])) or "-"
    line = (f"ended: {end['status']} · reward {reward}{said} · {end['turns']} turns, {end['tokens']} tokens · "
            f"policy versions {versions} · last finish {end['last_finish_reason'] or '-'}")
    why = end["error"] or end["stop_reason"]
    if why:
        line += f" · {why}"
    return Text(line, style="bold red" if end["status"] == "error" else "bold")
