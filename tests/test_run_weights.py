"""Which weights hold a run's version (rl/run_weights.py): pure file logic on a written-out run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from verbatim.datamodel import Rollout, Source, TokenColumns
from verbatim.errors import InputError
from verbatim.harness.store import RunManifest, TraceWriter
from verbatim.rl.run_weights import policy_weights, sampled_version
from verbatim.trainer.checkpoint import FILES, step_dir_name


def rollout(version: int) -> Rollout:
    tokens = TokenColumns(token_id=np.arange(4), source=np.array([0, 0, Source.MODEL, Source.MODEL]),
                          logprob=np.array([np.nan, np.nan, -0.5, -0.5]),
                          policy_version=np.array([-1, -1, version, version]), turn=np.zeros(4))
    return Rollout(run_id="r", group_id="g", rollout_id=f"r{version}", tokens=tokens, info={"step": version + 1})


@pytest.fixture
def run(tmp_path):
    """A 3-step training run that kept checkpoints 2 and 3 (model folders), from a base model folder."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    out = tmp_path / "run"
    TraceWriter(out, RunManifest(run_id="r", model=str(base), engine={"block_size": 16},
                                 config={"train": {"plan": {"steps": 3}}}))
    for n in (2, 3):
        folder = out / "checkpoints" / step_dir_name(n)
        folder.mkdir(parents=True)
        for name in (*FILES, "config.json"):
            (folder / name).write_text(json.dumps({"schema": 1, "step": n}) if name == "state.json" else "{}")
    return out, base


def test_the_default_version_is_the_newest_that_sampled_and_its_checkpoint_holds_the_weights(run):
    out, _ = run
    rollouts = [rollout(0), rollout(1), rollout(2)]
    assert sampled_version(rollouts) == 2
    chosen = policy_weights(out, rollouts, None, None)
    assert (chosen.version, chosen.folder, chosen.source) == (2, out / "checkpoints" / "step-000002",
                                                              "checkpoint step-000002")


def test_version_0_is_the_base_model_and_model_overrides_the_folder(run):
    out, base = run
    assert policy_weights(out, [rollout(2)], 0, None).folder == base
    given = policy_weights(out, [rollout(2)], 3, str(base))
    assert (given.version, given.folder, given.source) == (3, base, f"--model {base}")


@pytest.mark.parametrize("version,needle", [
    (99, "--trainer-version 99: "),  # the run never had it
    (-1, "--trainer-version -1: "),
    (1, "the weights of version 1 are not kept in"),  # pruned by --keep-checkpoints
])
def test_a_version_the_run_has_no_weights_of_is_one_line(run, version, needle):
    out, _ = run
    with pytest.raises(InputError) as refused:
        policy_weights(out, [rollout(2)], version, None)
    assert needle in refused.value.message
    if version == 1:
        assert "steps kept: 2, 3" in refused.value.message
    if version == 99:
        assert "versions 0 to 3" in refused.value.message
