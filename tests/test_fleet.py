"""Fleet bookkeeping without servers: CPU split, fleet files, and never signalling a stranger."""

from __future__ import annotations

import subprocess
import sys

import pytest

from verbatim.engine.fleet import FleetRecord, FleetReplica, fleet_down, read_fleet, split_cpus
from verbatim.errors import InputError


@pytest.mark.parametrize(("cpus", "n", "expected"), [
    ([0, 1], 2, ["0", "1"]),
    ([0, 1, 2, 3], 2, ["0,1", "2,3"]),
    ([0, 1, 2, 3, 4], 2, ["0,1", "2,3,4"]),
    ([0, 1], 3, ["0", "1", "0"]),
    ([5], 1, ["5"]),
])
def test_split_cpus(cpus, n, expected):
    assert split_cpus(cpus, n) == expected


def test_split_cpus_needs_a_replica():
    with pytest.raises(InputError):
        split_cpus([0, 1], 0)


def test_read_fleet_says_what_is_wrong(tmp_path):
    with pytest.raises(InputError, match="no fleet file"):
        read_fleet(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match="not a fleet file"):
        read_fleet(tmp_path / "bad.json")


def test_fleet_down_never_signals_a_process_that_is_not_a_vllm_server(tmp_path):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        record = FleetRecord(replicas=(FleetReplica(name="r0", url="http://127.0.0.1:1", pid=bystander.pid),))
        file = tmp_path / "fleet.json"
        file.write_text(record.model_dump_json())
        assert fleet_down(file, grace_s=1) == []
        assert bystander.poll() is None and not file.exists()
    finally:
        bystander.kill()
        bystander.wait()
