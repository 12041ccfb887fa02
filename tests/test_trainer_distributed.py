"""The learner on more than one process: groups split over ranks, FSDP2 on gloo, one update as one process makes.

The step of tests/distributed_step.py (a tiny random Llama, three groups of three rows, two updates,
PrefixFlow, clipping that bites) runs once alone and once as two processes that join a gloo group from
the environment torchrun sets. The gradients AdamW steps on, the pre-clip norm, the loss and the weights
the engine would receive must agree to PrefixFlow's float32 tolerance: a rank's gradient lost, counted
twice or averaged instead of summed shows in the norm and in every update.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_trainer_learner import assert_same_grads

from verbatim.engine.server import free_port
from verbatim.errors import InputError, TrainerError
from verbatim.trainer.distributed import ENVIRONMENT, on_this_machine
from verbatim.trainer.distributed.split import assign_groups, rows_of
from verbatim.trainer.distributed.team import Team, join

STEP = Path(__file__).resolve().parent / "distributed_step.py"
GRAD_REL = 3e-5
"""A team's gradient against one process's, per parameter, relative to its largest entry: float32 sums of the
ranks' shares in another order (measured up to 1.1e-5 on three ranks); a rank's share lost, doubled or averaged
is tens of percent."""


# -- the split: pure ----------------------------------------------------------------------------


@given(st.lists(st.integers(0, 5000), max_size=40), st.integers(1, 9))
def test_every_group_goes_to_one_rank_and_no_rank_carries_more_than_one_group_above_the_lightest(tokens, ranks):
    owned = assign_groups(tokens, ranks)
    assert len(owned) == ranks
    assert sorted(g for groups in owned for g in groups) == list(range(len(tokens)))
    loads = [sum(tokens[g] for g in groups) for groups in owned]
    assert max(loads) - min(loads) <= max(tokens, default=0)
    assert owned == assign_groups(list(tokens), ranks)  # every rank computes the same split


def test_groups_are_balanced_by_tokens_not_by_count():
    assert assign_groups([900, 100, 100, 100, 100, 100], 2) == [[0], [1, 2, 3, 4, 5]]
    assert assign_groups([5, 5, 5], 1) == [[0, 1, 2]]
    assert assign_groups([], 3) == [[], [], []]


@given(st.lists(st.integers(1, 6), min_size=1, max_size=12), st.integers(1, 5), st.data())
def test_the_ranks_rows_are_their_groups_whole(sizes, ranks, data):
    groups, start = [], 0
    for size in sizes:
        groups.append(list(range(start, start + size)))
        start += size
    lengths = data.draw(st.lists(st.integers(1, 300), min_size=start, max_size=start))
    per_rank = [rows_of(groups, lengths, ranks, rank) for rank in range(ranks)]
    assert sorted(r for rows in per_rank for r in rows) == list(range(start))
    for rows in per_rank:
        assert all(set(g) <= set(rows) or not set(g) & set(rows) for g in groups)


def test_a_bad_split_is_refused():
    with pytest.raises(TrainerError, match="at least one rank"):
        assign_groups([1], 0)
    with pytest.raises(TrainerError, match="rank 2 is not one of the 2 ranks"):
        rows_of([[0]], [3], 2, 2)


# -- the team -----------------------------------------------------------------------------------


def test_a_process_without_a_torch_distributed_environment_is_a_team_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert join("cpu") == Team(0, 1)
    assert Team().total(2.5) == 2.5 and Team().leader


def test_a_gpu_rank_binds_its_own_device_and_its_groups_carry_cpu_tensors_beside_cuda_ones(monkeypatch):
    """On CUDA every rank binds its own GPU before joining (else NCCL and torch's current device are cuda:0 on
    every rank), and its groups pair NCCL with gloo, so a CPU float64 sum (Team.total) and the object collectives
    (which torch runs on a group's CPU backend) are not refused by NCCL. Wired here without a GPU."""
    import torch.distributed as dist

    from verbatim.trainer.distributed import team

    assert (team.backend("cpu"), team.backend("cuda"), team.backend("cuda:3")) == (
        "gloo", "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl")
    assert team.bound_device("cuda:3") == torch.device("cuda:3")
    assert team.bound_device("cuda") is None and team.bound_device("cpu") is None
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("bind", device)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout, device_id: calls.append(
        ("join", backend, device_id)))
    monkeypatch.setattr(dist, "new_group", lambda backend, timeout: calls.append(("group", backend)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    assert join("cuda:1").rank == 1
    assert calls == [("bind", torch.device("cuda:1")), ("join", "cpu:gloo,cuda:nccl", torch.device("cuda:1")),
                     ("group", "cpu:gloo,cuda:nccl")]


def test_half_an_environment_is_refused_naming_what_is_missing(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(InputError, match="needs MASTER_ADDR, MASTER_PORT in the environment beside RANK, WORLD_SIZE"):
        join("cpu")


# -- two ranks, one update --------------------------------------------------------------------------


def _plain_env() -> dict[str, str]:
    """This environment without a team's variables, the tests' folder importable."""
    env = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STEP.parent), env.get("PYTHONPATH")) if p)
    return env


def _run(out: Path, ranks: int, *extra: str) -> dict:
    return _launch(ranks, [str(out), *extra])


def _launch(ranks: int, argv: list[str]) -> dict:
    """tests/distributed_step.py as ``ranks`` processes (one: alone); rank 0's result, or every job's."""
    env = _plain_env()
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(STEP), *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=env if ranks == 1 else env | on_this_machine(rank, ranks, port))
             for rank in range(ranks)]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    ended = [f"rank {rank}: exit {proc.returncode}, output: {text[-1200:]!r}"
             for rank, (proc, text) in enumerate(zip(procs, outputs, strict=True))]
    assert all(proc.returncode == 0 for proc in procs), "\n".join(ended)  # which rank, how far it got
    return torch.load(argv[0]) if argv[0] != "--jobs" else {}


def _steps(folder: Path, ranks: int, jobs: dict[str, list[str]]) -> dict[str, dict]:
    """Several steps made one after another by one launch of ``ranks`` processes (a launch each would pay the
    start of its processes and of their team again): each job's result by name."""
    folder.mkdir(parents=True, exist_ok=True)
    plan = folder / "jobs.json"
    plan.write_text(json.dumps([[str(folder / f"{name}.pt"), flags] for name, flags in jobs.items()]))
    _launch(ranks, ["--jobs", str(plan)])
    return {name: torch.load(folder / f"{name}.pt") for name in jobs}


def _model_folders(root: Path) -> dict[str, Path]:
    """The tiny model saved tied and untied, for the ranks that load their own shards of it."""
    from verbatim.bench.prefixflow_exactness import tiny_llama

    folders = {"tied": root / "tied", "untied": root / "untied"}
    for name, folder in folders.items():
        if not folder.exists():
            tiny_llama(tied=name == "tied", seed=1).save_pretrained(folder)
    return folders


STEPS = {"three-groups": [], "one-group": ["--case", "one-group"], "mixed": ["--case", "mixed"],
         "kl": ["--kl"], "untied": ["--untied"], "bf16": ["--dtype", "bf16"]}
"""The steps one process makes and a team of two makes again (``alone``, ``pair``)."""


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> dict[str, dict]:
    """Every step of :data:`STEPS` and the uneven case, each made by one process (one launch)."""
    return _steps(tmp_path_factory.mktemp("alone"), 1, STEPS | {"uneven": ["--case", "uneven"], "lora": ["--lora"],
                                                              "moe": ["--moe"]})


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, dict]:
    """Every step of :data:`STEPS` made by two ranks (one launch), the KL and untied ones each rank loading its
    own rows of the saved model, the steps whose gradients are averaged over the ranks instead of summed, and
    two checkpoints: one before any update, one after the step."""
    folder = tmp_path_factory.mktemp("pair")
    models = _model_folders(folder / "models")
    jobs = STEPS | {"kl": ["--kl", "--from", str(models["tied"])],
                    "untied": ["--untied", "--from", str(models["untied"])],
                    "averaged": ["--divide", "2"], "bf16-averaged": ["--dtype", "bf16", "--divide", "2"],
                    "empty": ["--no-step", "--save", str(folder / "empty")],
                    "lora": ["--lora", "--save", str(folder / "lora")],
                    "lora-shards": ["--lora", "--from", str(models["tied"])],
                    "moe": ["--moe"],
                    # last: its weight files of at most 60 kB (numbered, with an index)
                    "saved": ["--save", str(folder / "checkpoints"), "--file-bytes", "60000"]}
    return _steps(folder, 2, jobs)


def assert_same_step(two: dict, one: dict, ranks: int = 2) -> None:
    assert (two["team"], one["team"], two["version"]) == (ranks, 1, 1)
    assert (two["metrics"]["ranks"], one["metrics"]["ranks"]) == (ranks, 1)  # who trained the step
    assert len({tuple(sorted(c.items())) for c in two["collectives"]}) == 1, two["collectives"]  # in lockstep
    assert two["metrics"]["padding_tokens"] == one["metrics"]["padding_tokens"]  # each rank's, summed
    assert len(two["updates"]) == len(one["updates"]) == 2
    for mine, theirs in zip(two["updates"], one["updates"]):
        assert_same_grads(mine, theirs, rel=GRAD_REL)
    for key in ("loss", "grad_norm", "grad_norm_max", "entropy", "kl_ref"):
        if one["metrics"][key] is None:  # kl_ref, in a step without a KL penalty
            assert two["metrics"][key] is None, key
            continue
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key
    counts = ("rows", "updates", "kept_tokens", "outside_support")  # outside_support: each rank's rows, summed
    assert {k: two["metrics"][k] for k in counts} == {k: one["metrics"][k] for k in counts}
    assert sorted(two["weights"]) == sorted(one["weights"])  # the tied output layer once, as one process sends
    # AdamW's first step moves a weight by about lr × g / (|g| + 1e-8): a gradient entry near 1e-9, rounding of
    # sums made in another order, moves by lr × 10 % on one team and lr × 11 % on another; 1 % of lr (1e-3) bounds it
    for name, expected in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], expected, rtol=1e-6, atol=1e-5, msg=name)


def test_ranks_on_gloo_make_the_update_one_process_makes(alone, pair):
    one = alone["three-groups"]
    assert one["metrics"]["grad_norm"] > 0.5  # the cap bites: the clipped gradient is what AdamW steps on
    assert 0 < one["metrics"]["outside_support"] < one["metrics"]["model_tokens"]
    assert_same_step(pair["three-groups"], one)
    assert pair["three-groups"]["collectives"][0]["reduce_scatter"] > 0


@pytest.mark.parametrize("case", ["one-group", "mixed"])
def test_uneven_shares_of_the_ranks_make_the_update_one_process_makes(alone, pair, case):
    """A rank with no row at all, a rank of plain rows beside one running PrefixFlow: every rank makes the same
    collectives, the short one with idle calls whose gradient is 0, and the team makes one process's update."""
    assert_same_step(pair[case], alone[case])


def test_three_ranks_with_uneven_groups_in_token_budget_microbatches_make_the_update_one_process_makes(alone,
                                                                                                    tmp_path):
    """Groups of different sizes and prefix lengths, one of plain rows, in microbatches of at most 40 tokens,
    over three ranks."""
    assert_same_step(_run(tmp_path / "team.pt", 3, "--case", "uneven"), alone["uneven"], 3)


@pytest.mark.parametrize("case", ["kl", "untied"])
def test_ranks_that_load_their_own_shards_make_the_update_one_process_makes(alone, pair, case):
    """Built on the meta device, each rank reading its rows of the saved model (a tied one with its KL reference
    loaded the same way; an untied one, whose embedding is a unit of its own): the same update as one process
    that loaded it whole. With the KL penalty, each rank computes the reference's log π on its own rows, summed
    over the team as π_old's are."""
    if case == "kl":
        assert alone["kl"]["metrics"]["kl_ref"] > 1e-3  # the reference was moved: the penalty and its pull are not 0
    assert_same_step(pair[case], alone[case])  # kl_ref compared too


def test_a_team_trains_a_lora_adapter_as_one_process_does_and_checkpoints_it_as_a_peft_folder(alone, pair):
    """The frozen base sharded beside the adapter in every unit: the adapter's gradients, its pushed tensors and
    the step's metrics are one process's; the checkpoint holds the adapter alone, gathered to rank 0."""
    from verbatim.trainer import lora

    one, two = alone["lora"], pair["lora"]
    assert one["updates"][0] and all(lora.is_adapter_name(name) for name in one["updates"][0])
    assert all(name.startswith(lora.PREFIX) for name in one["weights"])
    assert_same_step(two, one)
    folder = Path(two["written"])
    assert lora.is_adapter_folder(folder) and not (folder / "model.safetensors").exists()
    from safetensors.torch import load_file

    saved = load_file(str(folder / lora.WEIGHTS_FILE))
    assert saved.keys() == two["weights"].keys()
    assert all(torch.equal(saved[name], two["weights"][name]) for name in saved)


def test_a_lora_team_built_on_the_meta_device_makes_one_processs_update(alone, pair):
    """Each rank reads its own rows of the saved base and takes its shard of the same fresh adapter (the seed's A,
    drawn as one process draws it): the update of one process that attached the adapter to the whole model."""
    assert_same_step(pair["lora-shards"], alone["lora"])


def test_a_team_replays_recorded_routing_as_one_process_does(alone, pair):
    """A MoE's rows with recorded experts (Rollout Routing Replay): two ranks make one process's update, their
    routers sent to the same experts in PrefixFlow's phases and the plain rows alike."""
    assert_same_step(pair["moe"], alone["moe"])


def test_a_rank_that_skips_its_idle_calls_cannot_keep_step(tmp_path):
    """Without the agreed shape, the rank with no row makes no collective while the other gathers: the step
    fails at the team's timeout rather than training a wrong update."""
    env = _plain_env()
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(STEP), str(tmp_path / "step.pt"), "--case", "one-group",
                               "--no-idle", "--timeout", "5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env | on_this_machine(rank, 2, port)) for rank in range(2)]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert procs[0].returncode != 0 and not (tmp_path / "step.pt").exists(), outputs[0][-2000:]




def test_the_comparison_catches_gradients_averaged_over_the_ranks(alone, pair):
    averaged, one = pair["averaged"], alone["three-groups"]
    with pytest.raises(AssertionError):
        assert_same_step(averaged, one)
    assert averaged["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"] / 2, rel=1e-4)


def test_bf16_on_a_team_gathers_bfloat16_weights_reduces_in_float32_and_makes_one_processs_update(alone, pair):
    """FSDP's mixed precision: the decoder computes with bfloat16 weights (one process: autocast over float32,
    so its residual stream stays float32 and the two differ by bfloat16's rounding, not by a rank's gradient)."""
    one, two = alone["bf16"], pair["bf16"]
    assert one["gathered"] == ["torch.float32"] and two["gathered"] == ["torch.bfloat16"]
    assert {t.dtype for t in two["weights"].values()} == {torch.float32}  # the engine gets the float32 master
    for key in ("loss", "grad_norm"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=5e-3), key
    for mine, theirs in zip(two["updates"], one["updates"], strict=True):
        for name, grad in theirs.items():
            assert mine[name].dtype == torch.float32  # reduced and stepped on in float32
            assert float((mine[name] - grad).norm()) <= 0.1 * float(grad.norm()) + 1e-6, name
    averaged = pair["bf16-averaged"]
    assert averaged["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"] / 2, rel=5e-3)

# -- a rank that hangs ------------------------------------------------------------------------------


def test_a_hung_rank_ends_the_step_within_the_timeout_naming_it(tmp_path):
    from verbatim.bench.prefixflow_exactness import tiny_llama

    model_dir = tmp_path / "tiny"
    tiny_llama(tied=True, seed=1).save_pretrained(model_dir)
    env = _plain_env()
    done = subprocess.run([sys.executable, str(STEP.parent / "team_hang.py"), str(model_dir), str(tmp_path / "run"),
                           "8"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["first"] == 4  # both ranks answered the first step
    assert result["error"].startswith("trainer rank 1 gave no answer within 8 s (hung; stopped with the run): "
                                      "a trainer rank stopped during a training step"), result["error"]
    assert 8 <= result["seconds"] < 8 + 20  # bounded by the timeout, not by the days a follower waits between calls
    assert result["follower_codes"] == [-signal.SIGKILL]  # the hung rank is stopped with the run


# -- checkpoints: the optimizer's shards, any number of ranks -----------------------------------------


def _same_moments(mine: dict, theirs: dict) -> None:
    assert sorted(mine) == sorted(theirs)
    for name, state in theirs.items():
        assert sorted(mine[name]) == sorted(state), name
        for key, value in state.items():
            torch.testing.assert_close(mine[name][key], value, rtol=0, atol=0, msg=f"{name} {key}")


@pytest.fixture(scope="module")
def team_checkpoint(pair) -> tuple[Path, dict]:
    """Two ranks' step, checkpointed (its weights in files of at most 60 kB): the folder and the whole optimizer
    state the team held."""
    return Path(pair["saved"]["written"]), pair["saved"]


@pytest.fixture(scope="module")
def restored(pair, team_checkpoint, tmp_path_factory) -> dict[int, dict[str, dict]]:
    """The team's checkpoints (after the step, and before any update) restored by 1, 2 and 3 ranks (a launch
    each)."""
    folder = tmp_path_factory.mktemp("restored")
    jobs = {"step": ["--restore", str(team_checkpoint[0])], "empty": ["--restore", pair["empty"]["written"]]}
    return {ranks: _steps(folder / str(ranks), ranks, jobs) for ranks in (1, 2, 3)}


def test_a_team_writes_its_optimizer_as_shards_beside_the_whole_weights_file_by_file(team_checkpoint):
    from transformers import AutoModelForCausalLM

    from verbatim.trainer.checkpoint import latest_checkpoint, read_checkpoint

    path, saved = team_checkpoint
    assert latest_checkpoint(path.parent) == path and path.name == "step-000001"
    shards = sorted(p.name for p in (path / "optimizer").iterdir())
    assert ".metadata" in shards and len([s for s in shards if s.endswith(".distcp")]) == 2  # one file a rank
    assert not (path / "optimizer.pt").exists()
    state, weights = read_checkpoint(path)
    assert state["version"] == 1
    for name, tensor in saved["weights"].items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)
    files = sorted(path.glob("model-*-of-*.safetensors"))  # gathered and written a file at a time
    assert len(files) > 2 and (path / "model.safetensors.index.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # a Hugging Face folder, tied
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    for name, tensor in saved["weights"].items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_any_number_of_ranks_restores_the_teams_optimizer_state_exactly(team_checkpoint, restored, ranks):
    _, saved = team_checkpoint
    restored = restored[ranks]["step"]
    assert restored["team"] == ranks and restored["saved"]["version"] == 1
    _same_moments(restored["moments"], saved["moments"])
    assert sorted(restored["weights"]) == sorted(saved["weights"])
    for name, tensor in saved["weights"].items():
        torch.testing.assert_close(restored["weights"][name], tensor, rtol=0, atol=0, msg=name)


def test_a_team_checkpoint_missing_a_shard_is_not_complete(team_checkpoint, tmp_path):
    import shutil

    from verbatim.trainer.checkpoint import latest_checkpoint

    path, _ = team_checkpoint
    copy = tmp_path / "checkpoints" / path.name
    shutil.copytree(path, copy)
    (copy / "optimizer" / ".metadata").unlink()
    assert latest_checkpoint(copy.parent) is None


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_a_team_checkpoint_before_any_update_restores_an_empty_optimizer_state(pair, restored, ranks):
    """No fake step: a state filled with zeros and step 1 would bias AdamW's first real update."""
    written = Path(pair["empty"]["written"])
    assert (written / "optimizer.pt").is_file() and not (written / "optimizer").exists()
    assert restored[ranks]["empty"]["empty"] and restored[ranks]["empty"]["saved"]["version"] == 0
