"""verbatim show: a rollout's text turn by turn, decoded with the run's tokenizer, or its token ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.datamodel import Completion
from verbatim.harness.ledger import Ledger
from verbatim.harness.store import RunManifest, TraceWriter

runner = CliRunner()


def write_run(path: Path, tokenizer, model: str) -> Path:
    """Two guess rollouts, written in the order they finished: g0-r01 cut by --max-turns, then g0-r00 solved in
    two turns."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    rollouts = []
    for rid, replies, status in (("g0-r01", ["Twelve."], "truncated"), ("g0-r00", ["Is it 20?", "It is 7."], "ok")):
        ledger = Ledger()
        ledger.append_prompt(encode("Guess my number from 1 to 50."))
        for k, reply in enumerate(replies):
            ids = encode(reply)
            ledger.append_completion(Completion(
                token_ids=np.array(ids), logprobs=np.full(len(ids), -0.5), versions=np.full(len(ids), 3),
                finish_reason="stop", prompt_tokens=len(ledger), cached_tokens=0))
            if k < len(replies) - 1:
                ledger.append_observation(encode("Lower."))
        solved = status == "ok"
        reason = None if solved else "max turns (1) reached before the env was done"
        info = {"env": {"solved": solved}, "stop_reason": reason or "done"}
        rollouts.append(ledger.to_rollout(run_id="run", group_id="g0", rollout_id=rid, reward=float(solved),
                                          status=status, error=reason, info=info))
    manifest = RunManifest(run_id="run", model=model, renderer="smollm2", engine={"block_size": 32})
    writer = TraceWriter(path, manifest)
    writer.write_batch(rollouts)
    writer.write_manifest(manifest.model_copy(update={"status": "completed"}))
    return path


def flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())  # rich wraps at the terminal's width; no table rules


def test_show_lists_the_rollouts_and_reads_the_first_turn_by_turn(tmp_path, default_model_dir, default_tokenizer):
    run = write_run(tmp_path / "run", default_tokenizer, str(default_model_dir))
    result = runner.invoke(app, ["show", str(run)])
    assert result.exit_code == 0, result.output
    out = flat(result.stdout)
    assert "g0-r00 g0 ok 1 yes 2" in out and "g0-r01 g0 truncated 0 no 1" in out
    assert out.index("g0-r00 g0 ok") < out.index("g0-r01 g0 truncated")  # by id, not by when they finished
    assert "── prompt · tokens 0–" in out and "Guess my number from 1 to 50." in out
    assert "── turn 0 · model" in out and "Is it 20?" in out and "── env" in out and "Lower." in out
    assert "── turn 1 · model" in out and "It is 7." in out
    assert "logprob sum -" in out and "mean -0.50 · min -0.50 · version 3 · finish stop" in out
    assert "ended: ok · reward 1 · solved · 2 turns" in out and "policy versions 3" in out
    cut = flat(runner.invoke(app, ["show", str(run), "g0-r01"]).stdout)
    assert "rollouts of" not in cut and "Twelve." in cut and "Is it 20?" not in cut
    assert "ended: truncated · reward 0 · not solved" in cut and "max turns (1) reached" in cut


def test_show_falls_back_to_token_ids_when_the_tokenizer_cannot_be_loaded(tmp_path, default_tokenizer):
    run = write_run(tmp_path / "run", default_tokenizer, "/nonexistent/model")
    result = runner.invoke(app, ["show", str(run), "g0-r01"])
    assert result.exit_code == 0, result.output
    out = flat(result.stdout)
    reply = " ".join(map(str, default_tokenizer.encode("Twelve.", add_special_tokens=False)))
    assert "token ids shown: the tokenizer could not be loaded" in out and reply in out and "Twelve." not in out


def test_show_refuses_what_is_not_a_run_or_not_a_rollout_in_one_line(tmp_path, default_tokenizer):
    run = write_run(tmp_path / "run", default_tokenizer, "/nonexistent/model")
    for args, needle in (([str(tmp_path)], "is not a verbatim run"),
                         ([str(tmp_path / "nope")], "is not a directory"),
                         ([str(run), "r-nope"], "has no rollout 'r-nope'")):
        result = runner.invoke(app, ["show", *args])
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1 and needle in lines[0], result.stderr
