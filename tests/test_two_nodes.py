"""Two torchrun launchers on 127.0.0.1 as two nodes of one node's process each (``--nnodes 2 --nproc-per-node 1``).

With a static master address and with c10d rendezvous, the learner step of tests/distributed_step.py makes the
update one process makes (the comparison of tests/test_trainer_distributed.py), and `verbatim train` run by the
two launchers trains a step on the real engine (the session's tiny SmolLM2 server) with rank 0's node running the
loop: its metrics say two ranks trained it, π_old equals μ, `lint trace` is clean.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from killable_train import served
from subprocess_cli import cli, cli_env, communicate_or_stacks
from test_trainer_distributed import STEP, _plain_env, _run, assert_same_step

from verbatim.engine.server import free_port


def launchers(mode: str, port: int) -> list[list[str]]:
    """The two nodes' torchrun command lines (before the script and its arguments)."""
    common = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    if mode == "static":
        return [[*common, "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
                for node in range(2)]
    return [[*common, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes"]
            for _ in range(2)]


def run_nodes(commands: list[list[str]], env: dict[str, str], timeout: float) -> list[tuple[int, str]]:
    """Start every node's launcher, wait for them all: each one's exit code and output."""
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for command in commands]
    results = []
    for proc in procs:
        out, _ = communicate_or_stacks(proc, timeout)
        results.append((proc.returncode, out))
    return results


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("alone") / "step.pt", 1)


@pytest.mark.parametrize("mode", ["c10d"])  # a static master address: the killed node's test below
def test_two_nodes_make_the_update_one_process_makes(tmp_path, one_process, mode):
    out = tmp_path / "nodes.pt"
    results = run_nodes([[*launcher, str(STEP), str(out)] for launcher in launchers(mode, free_port())],
                        _plain_env(), timeout=300)
    assert all(code == 0 for code, _ in results), "\n".join(text[-3000:] for _, text in results)
    import torch

    assert_same_step(torch.load(out), one_process, ranks=2)


@pytest.mark.engine
@pytest.mark.slow
def test_two_nodes_train_a_step_on_the_real_engine(tmp_path, tiny_server):
    """The multi-node recipe of docs/scale.md on one machine: two launchers meeting by c10d rendezvous."""
    run = tmp_path / "run"
    args = ["-m", "verbatim.cli", "train", "--env", "graded_env:GradedFactory", "--steps", "1", "--groups", "2",
            "--group-size", "2", "--max-turns", "1", "--max-tokens", "8", "--lr", "3e-4", "--seed", "4",
            *served(tiny_server), "--out", str(run)]
    results = run_nodes([[*launcher, *args] for launcher in launchers("c10d", free_port())], cli_env(), timeout=600)
    assert all(code == 0 for code, _ in results), "\n".join(text[-3000:] for _, text in results)
    assert sum(text.count("┃ step ┃") for _, text in results) == 1  # rank 0's node alone prints the run's table
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["version"], x["rows"], x["trainer_ranks"]) for x in lines] == [(1, 1, 4, 2)]
    assert lines[0]["grad_norm"] > 0 and lines[0]["mismatch_mean_abs"] < 1e-4
    lint = cli("lint", "trace", str(run))
    assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.mark.engine
@pytest.mark.slow
def test_a_node_killed_mid_run_ends_the_run_naming_it_and_resume_finishes_it(tmp_path, tiny_server):
    """Node 1 (its launcher and its rank) SIGKILLed during step 2: node 0's run ends within the trainer timeout
    with one line naming rank 1 and its node, nothing past step 1 is committed, and the same two launches with
    ``--resume`` train steps 2 and 3 once each."""
    import signal
    import time

    import psutil

    run = tmp_path / "run"
    args = ["-m", "verbatim.cli", "train", "--env", "graded_env:GradedFactory", "--steps", "3", "--groups", "2",
            "--group-size", "2", "--max-turns", "1", "--max-tokens", "8", "--lr", "3e-4", "--seed", "4",
            *served(tiny_server), "--checkpoint-every", "1", "--trainer-timeout", "20", "--out", str(run)]
    nodes = launchers("static", free_port())
    logs = [(tmp_path / f"node{n}.out").open("w") for n in range(2)]
    procs = [subprocess.Popen([*nodes[n], *args], stdout=logs[n], stderr=subprocess.STDOUT, text=True, env=cli_env(),
                              start_new_session=True) for n in range(2)]
    deadline = time.monotonic() + 300
    metrics = run / "metrics.jsonl"
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert procs[0].poll() is None, (tmp_path / "node0.out").read_text()[-3000:]
        time.sleep(0.2)
    node = psutil.Process(procs[1].pid)  # the node: its launcher and the rank it started (in a session of its own)
    for proc in [node, *node.children(recursive=True)]:
        proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    procs[0].wait(timeout=120)
    ended_s = time.monotonic() - killed
    for log in logs:
        log.close()
    text = (tmp_path / "node0.out").read_text()
    assert procs[0].returncode != 0 and ended_s < 20 + 30, (ended_s, text[-3000:])
    ours = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and ours[0].startswith("error: trainer rank 1 (node 1, host "), text[-3000:]
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == [1]
    results = run_nodes([[*launcher, *args, "--resume"] for launcher in launchers("static", free_port())],
                        cli_env(), timeout=600)
    assert all(code == 0 for code, _ in results), "\n".join(text[-3000:] for _, text in results)
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [(x["step"], x["version"], x["trainer_ranks"]) for x in lines] == [(1, 1, 2), (2, 2, 2), (3, 3, 2)]
    lint = cli("lint", "trace", str(run))
    assert lint.returncode == 0, lint.stdout + lint.stderr
