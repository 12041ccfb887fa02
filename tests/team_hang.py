"""Rank 0 of a two-rank learner whose follower hangs: the run's pieces as ``verbatim train`` wires them.

Run by tests/test_trainer_distributed.py with a tiny model folder, an output folder and a timeout. Rank 0
starts its follower as ``--trainer-procs 2`` does, trains one step with it, stops the follower with
SIGSTOP (alive, silent: a hang, not a death), then trains again. It prints one JSON line: the error the
second step ended with and how many seconds it took to end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from test_trainer_learner import step_rows

from verbatim.errors import TeamError
from verbatim.jobs.train import TrainConfig
from verbatim.jobs.trainer_team import end_followers, join_team, leave_team, named_ranks, start_followers
from verbatim.rl.plan import TrainPlan
from verbatim.trainer.distributed.lead import Lead
from verbatim.trainer.learner import Learner
from verbatim.trainer.learner_config import LearnerConfig
from verbatim.trainer.reference import load_model


def main(model_dir: str, out: str, timeout_s: float) -> None:
    torch.set_num_threads(1)
    config = TrainConfig(engine={"model": model_dir}, placement={"trainer_procs": 2, "trainer_timeout_s": timeout_s},
                         output={"out": out},
                         plan=TrainPlan(steps=2, groups=2, group_size=2), learner=LearnerConfig(microbatch=2))
    followers = start_followers(config.model_dump_json(), 2, Path(out))
    result: dict[str, object] = {}
    try:
        rows = step_rows(load_model(model_dir), groups=2, size=2)  # traced by the whole model
        team, channel = join_team("cpu", timeout_s)
        learner = Lead(Learner(load_model(model_dir), config.learner, team=team), channel)
        with named_ranks(followers, timeout_s):
            result["first"] = learner.train_step(rows)["rows"]
            os.kill(followers[0].pid, signal.SIGSTOP)
            started = time.monotonic()
            try:
                learner.train_step(rows)
            except TeamError:
                result["seconds"] = time.monotonic() - started
                raise
    except TeamError as exc:
        result["error"] = exc.message
    finally:
        codes = end_followers(followers, wait_s=0.0)
        result["follower_codes"] = codes
        leave_team()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
