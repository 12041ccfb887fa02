"""Screenshots of ``verbatim view`` for docs/view.md: docs/view-*.png.

Builds the test suite's run directory (tests/view_runs.py: SmolLM2 tokens, a training run's
metrics, a cache miss, a mid-sequence weight update, hostile text), serves it on loopback and
photographs each view in Debian's headless chromium through Playwright.

    PYTHONPATH=src python scripts/view_screenshots.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import view_runs  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

from verbatim.engine.models import prepare  # noqa: E402
from verbatim.renderers.registry import get_renderer  # noqa: E402
from verbatim.view.server import make_server, serve_in_thread  # noqa: E402

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main() -> None:
    model_dir = prepare()
    renderer = get_renderer("smollm2", model_dir=model_dir)
    rollouts = view_runs.rollouts(renderer)
    run = view_runs.write_run(Path(tempfile.mkdtemp()) / "run", renderer, str(model_dir),
                              [rollouts[:2], rollouts[2:]], metrics=view_runs.step_metrics(6), trainer=rollouts[:1])
    server = make_server(run, 0)
    server.RequestHandlerClass.data.wait_for_lint(120)
    serve_in_thread(server)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    shots = [("run", "/#/", None), ("rollout", "/#/rollout/g0-r0", "source"),
             ("logprob", "/#/rollout/g0-r0", "logprob"), ("mask", "/#/rollout/g0-r0", "mask"),
             ("version", "/#/rollout/g0-r1", "version"), ("group", "/#/group/g0", None)]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 860})
        for name, path, mode in shots:
            page.goto(url + path)
            page.reload()
            page.wait_for_selector("body[data-ready='1']")
            if mode:
                page.select_option("#mode", mode)
            out = REPO / "docs" / f"view-{name}.png"
            page.screenshot(path=str(out))
            print(f"wrote {out.relative_to(REPO)}")
        browser.close()
    server.shutdown()


if __name__ == "__main__":
    main()
