"""The package stands on its own: the wheel, installed apart from the checkout, has its templates and tokenizers.

The wheel is built from this checkout and installed without dependencies into a fresh virtualenv;
the third-party packages it needs are borrowed from the test environment through a ``.pth`` line
(a plain path, so the checkout's own editable install is not picked up). Commands run from an
empty folder, with no ``PYTHONPATH`` and no ``VERBATIM_SHARED_TEMPLATES``: everything verbatim
reads must come from inside the installed package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from this checkout (setuptools, no build isolation: no download)."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(REPO)], check=True, capture_output=True, timeout=600)
    (built,) = out.glob("verbatim_rl-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """``(bin folder, environment)`` of a fresh virtualenv holding only the built wheel."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    venv_python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv_python), "install", "--quiet",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    site = subprocess.run([str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VERBATIM_SHARED_TEMPLATES")}
    env["HF_HUB_OFFLINE"] = "1"
    return venv / "bin", env


def _run(installed: tuple[Path, dict[str, str]], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    bin_dir, env = installed
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_wheel_carries_every_template_tokenizer_and_licence(wheel: Path) -> None:
    from verbatim.paths import PACKAGE_TEMPLATES

    shipped = {p.relative_to(PACKAGE_TEMPLATES.parent.parent).as_posix()
               for p in PACKAGE_TEMPLATES.rglob("*") if p.is_file()}
    assert len([s for s in shipped if s.endswith(".jinja")]) == 29
    assert "verbatim/chat_templates/SOURCES.md" in shipped
    assert "verbatim/chat_templates/tokenizers/llama3/LICENSE.llama3_1" in shipped
    with zipfile.ZipFile(wheel) as archive:
        built = set(archive.namelist())
    assert shipped <= built, sorted(shipped - built)[:5]
    assert {"verbatim/bench/data/router_workload.json", "verbatim/renderers/default_conversations.jsonl"} <= built
    page = {f"verbatim/view/static/{name}" for name in ("index.html", "view.css", "view.js", "tokens.js", "chart.js")}
    assert page <= built, sorted(page - built)  # verbatim view's page is served from the package


@pytest.mark.slow
def test_the_installed_package_runs_from_outside_the_checkout(installed, tmp_path: Path) -> None:
    where = _run(installed, tmp_path, "python", "-c", "import verbatim; print(verbatim.__file__)")
    assert where.returncode == 0, where.stderr
    assert REPO not in Path(where.stdout.strip()).parents and "site-packages" in where.stdout
    help_text = _run(installed, tmp_path, "verbatim", "--help")
    assert help_text.returncode == 0 and "lint" in help_text.stdout and "run" in help_text.stdout


@pytest.mark.slow
def test_lint_template_with_a_shipped_tokenizer_from_the_wheel(installed, tmp_path: Path) -> None:
    """llama3's real tokenizer file and official template, read from the installed package only."""
    from verbatim.renderers import drift
    from verbatim.renderers.conversations import DEFAULT_CONVERSATIONS, load_conversations
    from verbatim.renderers.templates import resolve_template, resolve_tokenizer

    result = _run(installed, tmp_path, "verbatim", "lint", "template", "--template", "llama3",
                  "--tokenizer", "llama3", "--json")
    assert result.returncode in (0, 1), result.stderr  # 1: drift found; 2 would be a missing file
    verdicts = [json.loads(line) for line in result.stdout.splitlines()]
    _, text = resolve_template("llama3")
    expected = drift.lint(drift.TemplateRenderer(text, resolve_tokenizer("llama3", None)),
                          load_conversations(DEFAULT_CONVERSATIONS))
    assert verdicts == [v.as_json() for v in expected]
    assert list(tmp_path.iterdir()) == []  # nothing written where it ran
