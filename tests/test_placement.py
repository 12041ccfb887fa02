"""Where the engine and the trainer run: the placement check (pure), the flags that reach it, and the
flags that reach vLLM (its own config built from ours, and the server's command line).

This machine has no GPU: what a GPU run does with these settings is not run here (docs/scale.md).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.engine.fleet import fleet_gpus, split_devices
from verbatim.engine.runtime import VLLM_GPU_MEMORY, EngineConfig
from verbatim.errors import InputError
from verbatim.jobs.config import device_list
from verbatim.jobs.placement import TrainerSize, bytes_per_parameter, check_placement, trainer_bytes

GIB = 1 << 30
runner = CliRunner()


def test_a_cpu_run_asks_nothing_of_gpus():
    check_placement([], trainer_device="cpu", parameters=10**9)
    check_placement([], tensor_parallel=2)  # the CPU engine's own tensor parallelism: vLLM's to refuse


def test_a_gpu_share_without_a_gpu_is_refused():
    with pytest.raises(InputError, match="--engine-gpu-memory 0.5: this machine has no GPU"):
        check_placement([], gpu_memory=0.5)


def test_more_tensor_parallel_gpus_than_there_are_is_refused():
    with pytest.raises(InputError, match="--engine-tensor-parallel 4 needs 4 GPUs; this process sees 2"):
        check_placement([80 * GIB, 80 * GIB], tensor_parallel=4)
    check_placement([80 * GIB, 80 * GIB], tensor_parallel=2)


def test_a_served_engine_is_placed_where_it_is_started():
    with pytest.raises(InputError, match="a served engine is placed where it is started"):
        check_placement([80 * GIB], engine="http", gpu_memory=0.5)
    check_placement([80 * GIB], engine="http", trainer_device="cuda:0", parameters=10**9)  # all of it the trainer's


def test_a_colocated_trainer_gets_what_the_engine_leaves_and_the_line_names_the_numbers():
    one_billion = 10**9  # 16 GB of fp32 weights, gradients and AdamW moments (14.9 GiB)
    with pytest.raises(InputError) as refused:
        check_placement([80 * GIB], trainer_device="cuda:0", parameters=one_billion)
    line = str(refused.value)
    assert "shares GPU 0 with the engine, which takes 0.92 of its 80.0 GiB (vLLM's default), leaving 6.4 GiB" in line
    assert "needs at least 14.9 GiB (1.00 B parameters × 16 bytes" in line
    check_placement([80 * GIB], trainer_device="cuda:0", parameters=one_billion, gpu_memory=0.5)  # 40 GiB left
    check_placement([80 * GIB, 80 * GIB], trainer_device="cuda:1", parameters=one_billion)  # a GPU of its own
    with pytest.raises(InputError, match="shares GPU 1 with the engine"):
        check_placement([80 * GIB, 80 * GIB], trainer_device="cuda:1", parameters=one_billion, tensor_parallel=2)


def test_a_trainer_alone_on_a_gpu_too_small_is_refused():
    with pytest.raises(InputError, match=r"the trainer needs at least 134.1 GiB .* the GPU has 80.0 GiB"):
        check_placement([80 * GIB, 80 * GIB], trainer_device="cuda:1", parameters=8 * 10**9, dtype="bf16")


@given(total=st.integers(1, 200), share=st.one_of(st.none(), st.floats(0.05, 1.0)),
       parameters=st.integers(0, 20 * 10**9), dtype=st.sampled_from(["fp32", "bf16"]),
       colocated=st.booleans(), reference=st.booleans())
def test_refused_exactly_when_the_floor_exceeds_the_room(total, share, parameters, dtype, colocated, reference):
    gpus = [total * GIB, total * GIB]
    device = "cuda:0" if colocated else "cuda:1"
    room = total * GIB * (1 - (VLLM_GPU_MEMORY if share is None else share)) if colocated else total * GIB
    try:
        check_placement(gpus, gpu_memory=share, trainer_device=device, parameters=parameters, dtype=dtype,
                        reference=reference)
        refused = False
    except InputError:
        refused = True
    assert refused == (trainer_bytes(parameters, dtype, reference=reference) > room)


def test_a_kl_penaltys_reference_costs_four_more_bytes_a_parameter_on_every_rank():
    assert bytes_per_parameter("fp32", reference=True) == 20
    check_placement([20 * GIB], engine="http", trainer_device="cuda:0", parameters=10**9)  # 14.9 GiB fits
    with pytest.raises(InputError) as refused:  # 18.6 GiB with the reference does not
        check_placement([18 * GIB], engine="http", trainer_device="cuda:0", parameters=10**9, reference=True)
    assert ("needs at least 18.6 GiB (1.00 B parameters × 20 bytes: float32 weights, gradients and AdamW state, "
            "the KL penalty's float32 reference); the GPU has 18.0 GiB") in str(refused.value)


def test_fleet_devices_are_split_by_tensor_parallel_without_reuse():
    assert split_devices((0, 1, 2, 3), 2, 2) == [(0, 1), (2, 3)]
    assert split_devices((3, 1), 2, 1) == [(3,), (1,)]
    assert split_devices(None, 3, 2) == [None, None, None]
    with pytest.raises(InputError, match="--devices names 3 GPUs; 2 replicas × --tensor-parallel 2 use 4"):
        split_devices((0, 1, 2), 2, 2)
    with pytest.raises(InputError, match="names a GPU twice"):
        split_devices((0, 0), 2, 1)
    assert device_list("0,2") == (0, 2) and device_list(None) is None
    with pytest.raises(InputError, match="must be GPU indices"):
        device_list("0,gpu1")


def test_fleet_replicas_without_devices_get_gpus_of_their_own():
    assert fleet_gpus(None, 0, 4, 1, None) == [None] * 4  # a CPU machine
    assert fleet_gpus(None, 8, 1, 2, None) == [None]  # one replica sees what fleet up sees
    assert fleet_gpus(None, 8, 4, 1, None) == [(0,), (1,), (2,), (3,)]
    assert fleet_gpus(None, 8, 2, 4, None) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert fleet_gpus((6, 7), 8, 2, 1, None) == [(6,), (7,)]  # named ones win
    assert fleet_gpus(None, 2, 4, 1, 0.45) == [(0,), (1,), (0,), (1,)]  # shared, each taking under half
    with pytest.raises(InputError, match="4 replicas × --tensor-parallel 1 need 4 GPUs; this machine shows 2"):
        fleet_gpus(None, 2, 4, 1, None)  # vLLM's default share (0.92) twice on one GPU cannot start
    with pytest.raises(InputError, match="need 3 GPUs; this machine shows 2") as refused:
        fleet_gpus(None, 2, 3, 1, 0.6)  # two replicas of 0.6 on GPU 0
    assert "--gpu-memory at most 0.50 (2 replicas on a GPU)" in refused.value.hint
    with pytest.raises(InputError, match="need 4 GPUs; this machine shows 3"):
        fleet_gpus(None, 3, 2, 2, 0.3)  # a tensor-parallel replica is never spread over shared GPUs


def test_a_servers_gpus_are_counted_within_our_own_cuda_visible_devices():
    from verbatim.engine.server import child_devices

    assert child_devices((0, 1), None) == "0,1" and child_devices((1,), "") == "1"
    assert child_devices((0, 1), "4,5,6") == "4,5"  # GPU 0 of ours is the machine's GPU 4
    assert child_devices((1,), "GPU-aa, GPU-bb") == "GPU-bb"
    with pytest.raises(InputError, match="--devices names GPU 2, but CUDA_VISIBLE_DEVICES=4,5 shows 2"):
        child_devices((0, 2), "4,5")


def test_a_fleet_whose_gpus_are_not_all_visible_is_refused_before_any_replica_starts(monkeypatch, tmp_path):
    from verbatim.engine import fleet

    started = []
    monkeypatch.setattr(fleet.ServerProcess, "launch", lambda self: started.append(self) or self)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    config = EngineConfig(model="default", devices=(0, 1, 2))
    with pytest.raises(InputError, match="--devices names GPU 2, but CUDA_VISIBLE_DEVICES=4,5 shows 2"):
        fleet.fleet_up(config, 3, tmp_path / "fleet.json")
    assert started == [] and not (tmp_path / "fleet.json").exists()


def test_the_server_command_carries_the_placement(default_model_dir):
    from verbatim.engine.server import server_command

    argv, env = server_command(EngineConfig(model=str(default_model_dir), gpu_memory=0.45, tensor_parallel=2,
                                            devices=(2, 3)))
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.45"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    plain, plain_env = server_command(EngineConfig(model=str(default_model_dir)))
    assert "--tensor-parallel-size" not in plain and "--gpu-memory-utilization" not in plain
    assert plain_env.get("CUDA_VISIBLE_DEVICES") == __import__("os").environ.get("CUDA_VISIBLE_DEVICES")


def test_the_in_process_engine_settings_reach_vllms_own_config(default_model_dir):
    """vLLM builds its config from our arguments (no engine starts): the share and the parallel size arrive."""
    from vllm_config_probe import vllm_config

    config = EngineConfig(model=str(default_model_dir), gpu_memory=0.4, tensor_parallel=3)  # 9 heads, 3 KV heads
    built = vllm_config(config, default_model_dir)
    assert built.cache_config.gpu_memory_utilization == 0.4
    assert built.parallel_config.tensor_parallel_size == 3
    default = vllm_config(EngineConfig(model=str(default_model_dir)), default_model_dir)
    assert default.cache_config.gpu_memory_utilization == VLLM_GPU_MEMORY


@pytest.mark.parametrize("command", ["run", "train"])
@pytest.mark.parametrize("flags,gpus,needle", [
    (["--engine-gpu-memory", "0.5"], [], "--engine-gpu-memory 0.5: this machine has no GPU"),
    (["--engine-tensor-parallel", "2"], [16 * GIB], "--engine-tensor-parallel 2 needs 2 GPUs; this process sees 1"),
])
def test_the_commands_refuse_a_bad_placement_before_anything_starts(tmp_path, monkeypatch, command, flags, gpus,
                                                                   needle):
    """The machine's GPUs stand in as ``gpus`` (this one has none to show a second case)."""
    monkeypatch.setattr("verbatim.trainer.reference.visible_gpus", lambda: gpus)
    out = tmp_path / "run"
    result = runner.invoke(app, [command, "--env", "guess", "--out", str(out), *flags])
    assert result.exit_code == 2, result.output
    assert needle in result.output and not out.exists()


def test_a_sharded_trainers_rank_needs_its_share_and_what_it_gathers_at_once():
    assert bytes_per_parameter("fp32") == 16 and bytes_per_parameter("bf16") == 18
    one_billion = 10**9
    size = TrainerSize.of(one_billion, root=10**8, units=[10**7, 3 * 10**7, 2 * 10**7])
    assert size.unit == 3 * 10**7  # the largest unit
    # 16/4 bytes of every parameter; (root + largest unit) × (4 + 4): weights and gradient, gathered in float32
    assert trainer_bytes(size, "fp32", 4) == one_billion * 4 + 13 * 10**7 * 8
    assert trainer_bytes(size, "bf16", 4) == one_billion * 4 + 13 * 10**7 * 4  # gathered in bfloat16 (2 + 2)
    assert trainer_bytes(size, "fp32", 4, reference=True) == trainer_bytes(size, "fp32", 4) + one_billion  # 4/4
    with pytest.raises(InputError) as refused:  # a rank of 2: 8.4 GiB, above the 6.4 GiB the engine leaves of GPU 0
        check_placement([80 * GIB], trainer_device="cuda:0", parameters=size, ranks=2)
    assert ("each of the 2 trainer ranks needs at least 8.4 GiB (1.00 B parameters × 8 bytes: 1/2 of the float32 "
            "weights, gradients and AdamW state; 0.13 B gathered at once during a step × 8 bytes: the output layer "
            "and the largest unit with their gradients)") in str(refused.value)
    with pytest.raises(InputError):
        check_placement([12 * GIB, 12 * GIB], trainer_device="cuda:1", parameters=one_billion)  # one process: 14.9
    check_placement([12 * GIB, 12 * GIB], trainer_device="cuda:1", parameters=size, ranks=4)  # a rank: 4.7


def test_each_rank_finds_its_device_from_its_local_rank():
    from verbatim.jobs.placement import machine_devices, rank_device

    assert rank_device("cpu", None, None) == "cpu" and rank_device("cpu", None, 3) == "cpu"
    assert rank_device("cuda", None, None) == "cuda" and rank_device("cuda", None, 3) == "cuda:3"
    assert rank_device("cuda:1", None, 0) == "cuda:1"  # one named GPU: every rank's (refused if several)
    assert rank_device("cpu", (2, 3, 4), 1) == "cuda:3" and rank_device("cuda", (5,), None) == "cuda:5"
    with pytest.raises(InputError, match="--trainer-devices 2,3 names 2 GPUs for local trainer rank 2"):
        rank_device("cpu", (2, 3), 2)
    assert machine_devices("cpu", (2, 3, 4, 5, 6, 7), 6) == [f"cuda:{i}" for i in range(2, 8)]
    assert machine_devices("cuda", None, 4) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert machine_devices("cuda", None, 1) == ["cuda"]


def test_on_this_machine_a_rank_learns_its_local_rank_as_torchrun_would_say_it():
    from verbatim.trainer.distributed import on_this_machine

    env = on_this_machine(2, 4, 29500)
    assert env["LOCAL_RANK"] == env["RANK"] == "2" and env["LOCAL_WORLD_SIZE"] == env["WORLD_SIZE"] == "4"


def test_engine_on_gpus_0_and_1_and_six_trainer_ranks_on_2_to_7_is_a_placement_the_code_makes():
    """docs/scale.md's layout: every rank's device checked, the engine's weights against its share of each of its
    GPUs in its format."""
    eight = [80 * GIB] * 8
    qwen3_8b = TrainerSize.of(8_190_735_360, 622_329_856 + 4096, [194_000_000])
    check_placement(eight, engine_devices=(0, 1), trainer_device="cpu", trainer_devices=(2, 3, 4, 5, 6, 7),
                    ranks_here=6, parameters=qwen3_8b, dtype="bf16", ranks=6, engine_dtype="bf16")
    small = eight[:5] + [8 * GIB] + eight[6:]  # GPU 5, local rank 3's, holds too little
    with pytest.raises(InputError, match=r"--trainer-device cuda:5: each of the 6 trainer ranks needs at least"):
        check_placement(small, engine_devices=(0, 1), trainer_device="cpu", trainer_devices=(2, 3, 4, 5, 6, 7),
                        ranks_here=6, parameters=qwen3_8b, dtype="bf16", ranks=6)


@pytest.mark.parametrize("engine,trainer,needle", [
    ((0, 1), (1, 2), "--engine-devices and --trainer-devices both name GPU 1"),
    ((0, 8), (2,), "--engine-devices names GPU 8, but this process sees 8 GPUs (0..7)"),
    (None, (2, 9), "--trainer-devices names GPU 9, but this process sees 8 GPUs"),
    ((0, 0), (2,), "--engine-devices names GPU 0 twice"),
    (None, (3, 4, 3), "--trainer-devices names GPU 3 twice"),
])
def test_device_maps_that_overlap_or_name_a_gpu_not_there_are_refused(engine, trainer, needle):
    with pytest.raises(InputError) as refused:
        check_placement([80 * GIB] * 8, engine_devices=engine, trainer_device="cpu", trainer_devices=trainer,
                        ranks_here=len(trainer))
    assert needle in str(refused.value)


def test_the_engines_weights_are_counted_in_its_format_over_its_gpus():
    eight_b = 8 * 10**9  # fp32: 29.8 GiB; bf16: 14.9 GiB
    with pytest.raises(InputError, match=r"the engine's weights in fp32 take 29.8 GiB of GPU 0 .* more than its "
                       r"share 0.92 of 24.0 GiB"):
        check_placement([24 * GIB], parameters=eight_b, engine_dtype="fp32")
    check_placement([24 * GIB], parameters=eight_b, engine_dtype="bf16")
    check_placement([24 * GIB, 24 * GIB], engine_devices=(0, 1), parameters=eight_b, engine_dtype="fp32")
    with pytest.raises(InputError, match="--engine-gpu-memory"):
        check_placement([24 * GIB], gpu_memory=0.5, parameters=eight_b, engine_dtype="bf16")


def test_engine_devices_set_its_parallelism_and_name_its_gpus():
    from verbatim.jobs.config import EngineChoice

    assert EngineChoice(devices=(0, 1)).gpus == (0, 1) and EngineChoice(tensor_parallel=2).gpus == (0, 1)
    assert EngineChoice(devices=(2, 3), tensor_parallel=2).gpus == (2, 3)
    with pytest.raises(ValueError, match="--engine-devices 0,1 names 2 GPUs but --engine-tensor-parallel is 4"):
        EngineChoice(devices=(0, 1), tensor_parallel=4)


def test_the_in_process_engines_processes_see_its_devices_while_it_starts(monkeypatch):
    import os

    from verbatim.engine.server import visible_devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    with visible_devices((2, 3)):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"  # GPUs 2 and 3 of ours
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with visible_devices((1,)):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    with visible_devices(None):
        assert "CUDA_VISIBLE_DEVICES" not in os.environ


@pytest.mark.parametrize("flags,needle", [
    (["--engine-devices", "0,1"], "--engine-devices: this machine has no GPU"),
    (["--engine-devices", "0,x"], "--engine-devices '0,x' must be GPU indices"),
    (["--engine-devices", "0,1", "--engine-tensor-parallel", "4"], "names 2 GPUs but --engine-tensor-parallel is 4"),
    (["--trainer-device", "cuda:1", "--trainer-devices", "2,3"], "both place the trainer: give one"),
])
def test_bad_device_maps_are_one_line_exit_2_before_anything_starts(tmp_path, flags, needle):
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--env", "guess", *flags, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert needle in result.output and len(result.output.strip().splitlines()) <= 2, result.output
    assert not out.exists()


def test_a_rank_on_another_node_checks_its_gpu_with_no_engine_beside_it():
    one_billion = 10**9  # 14.9 GiB: too much beside an engine at vLLM's default share of 80 GiB, fine alone
    with pytest.raises(InputError, match="shares GPU 0 with the engine"):
        check_placement([80 * GIB], trainer_device="cuda:0", parameters=one_billion)
    check_placement([80 * GIB], engine="none", trainer_device="cuda:0", parameters=one_billion)
    with pytest.raises(InputError, match="the GPU has 8.0 GiB"):
        check_placement([8 * GIB], engine="none", trainer_device="cuda:0", parameters=one_billion)
