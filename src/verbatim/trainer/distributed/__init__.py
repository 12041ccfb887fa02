"""The trainer on more than one process: torch.distributed, FSDP2 sharding, a step's groups split over ranks.

:mod:`.team` is the process group the learner's ranks share (gloo on CPU, NCCL on GPUs); :mod:`.split`
assigns a step's groups to ranks whole, balanced by tokens (pure); :mod:`.sharding` shards a model with
FSDP2 and runs one optimizer update's forward and backward on each rank's own rows.
"""

ENVIRONMENT = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""The variables torchrun sets and a rank joins its team from (here, free of torch: the CLI reads them at start)."""


def on_this_machine(rank: int, size: int, port: int) -> dict[str, str]:
    """The environment of rank ``rank`` of a team of ``size`` processes started on this machine, meeting at
    127.0.0.1:``port`` (what torchrun sets for one node: its rank on the node too, which picks its GPU)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(size)}
