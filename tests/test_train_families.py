"""`verbatim train --model DIR` on families other than the default model's, on the real engine.

Tiny random folders (`verbatim models tiny`: the family's config class, its real tokenizer and
official chat template) are trained for 2 steps through the CLI, each in its own process with its own
in-process vLLM engine: the renderer is detected from the folder's template, versions go 0 → 2,
`lint trace` is clean, every step trains through the family's PrefixFlow adapter, and the weights the
engine holds after a push are the trainer's: each synchronous step's π_old equals the μ its rollouts
were sampled with (fp32 agreement), and the tokens of step 1 have the logprobs of the checkpoint of
step 1, not the base weights' (so a push that did not arrive fails). The env's rewards differ within a
group (tests/graded_env.py), so every step moves the weights. A command that starts its engine times the start
apart from the steps (the summary's ``engine_start_s``) and keeps vLLM's notes in the run's engine.log, off the
terminal. Qwen3 trains so in its MoE form, with Rollout Routing
Replay (tests/test_routing_engine.py: one engine start for both).
"""

from __future__ import annotations

import json

import pytest
from subprocess_cli import cli
from trained_run import assert_sampled_with_previous_checkpoint, assert_two_steps

from verbatim.harness.store import read_manifest
from verbatim.harness.tiny_models import write_tiny_model

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.mark.parametrize("family,renderer", [("gemma2", "gemma2")])
def test_a_tiny_model_of_another_family_trains_end_to_end(tmp_path, family, renderer):
    model_dir = write_tiny_model(family, tmp_path / family, seed=0)
    out = tmp_path / "run"
    done = cli("train", "--model", str(model_dir), "--env", "graded_env:GradedFactory", "--steps", "2", "--groups",
               "1", "--group-size", "3", "--max-turns", "1", "--max-tokens", "8", "--lr", "1e-2", "--seed", "4",
               "--max-model-len", "512", "--kv-cache-gib", "1", "--checkpoint-every", "1", "--out", str(out),
               "--summary-json", str(tmp_path / "summary.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["engine_start_s"] > 1  # not folded into the steps'
    assert (out / "engine.log").stat().st_size > 0
    noise = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(noise) < 10, done.stderr[-3000:]  # the terminal is not flooded with the engine's notes
    assert read_manifest(out).renderer == renderer  # detected from the folder's chat template
    assert_two_steps(out, trainer_path="prefixflow", rows=3)
    assert_sampled_with_previous_checkpoint(out, model_dir)
