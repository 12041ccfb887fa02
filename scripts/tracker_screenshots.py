"""Screenshots of a real run in TensorBoard for docs/trainer.md: docs/tracker-*.png.

Trains the default model as ``make demo`` does (its training run) with ``--log tensorboard``, serves
``RUN_DIR/tensorboard`` with TensorBoard's own server on loopback, and photographs its scalars and the
rollout table in Debian's headless chromium through Playwright. Takes a few minutes on 2 cores.

    PYTHONPATH=src .venv/bin/python scripts/tracker_screenshots.py [RUN_DIR]

With RUN_DIR (a run trained with ``--log tensorboard``) nothing is trained.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TRAIN = ["--env", "guess", "--env-arg", "high=5", "--env-arg", "max_guesses=3", "--steps", "6", "--groups", "4",
         "--group-size", "8", "--max-turns", "3", "--max-tokens", "12", "--lr", "1e-4", "--log", "tensorboard"]
"""``make demo``'s training run (Makefile), with ``--log tensorboard``."""
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def train(out: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    command = [str(BIN / "verbatim"), "train", *TRAIN, "--out", str(out)]
    print("$ " + " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True, env=env)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(logdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    name = logdir.parent.name  # the run's folder, as the trackers name the run
    server = subprocess.Popen([str(BIN / "tensorboard"), "--logdir_spec", f"{name}:{logdir}", "--host", "127.0.0.1",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    for _ in range(120):
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return server, url
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("tensorboard did not answer within 60 s")


def scalars(page, url: str) -> None:
    """Time series, four of the step's metrics."""
    page.goto(url + "#timeseries")
    page.get_by_placeholder("Filter tags (regex)").last.fill("reward_mean|loss|cache_hit_rate|mismatch_mean_abs")
    page.get_by_text("reward_mean").first.wait_for(timeout=60_000)
    pane = page.get_by_role("button", name="Toggle settings side pane")
    if not page.get_by_text("Horizontal Axis").count():  # the settings pane, open on a first visit only
        pane.click()
    smoothing = page.locator("input[aria-labelledby='scalars-smoothing-label']")
    smoothing.fill("0")  # each step's own value, as metrics.jsonl has it
    smoothing.press("Enter")
    page.get_by_label("Ignore outliers in chart scaling").uncheck()  # a short run's every point in view
    pane.click()


def table(page, url: str) -> None:
    """The Text dashboard: the last step's rollout table (the config folded away)."""
    page.goto(url + "#text")
    page.get_by_text("rollout_table").first.wait_for(timeout=60_000)
    page.get_by_text("config", exact=True).first.click()


def photograph(url: str) -> None:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        for shoot in (scalars, table):
            shoot(page, url)
            page.wait_for_timeout(3_000)  # the charts and tables draw after their data arrives
            out = REPO / "docs" / f"tracker-{shoot.__name__}.png"
            page.screenshot(path=str(out))
            print(f"wrote {out.relative_to(REPO)}")
        browser.close()


def main() -> None:
    run = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "run"
    if len(sys.argv) == 1:
        train(run)
    if not (run / "tensorboard").is_dir():
        raise SystemExit(f"{run} has no tensorboard/ folder: train it with --log tensorboard")
    server, url = serve(run / "tensorboard")
    try:
        photograph(url)
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
