"""verbatim view: the JSON the page reads, the command's bad input, and the page itself in headless Chromium.

Run directories are written by the test (tests/view_runs.py: real SmolLM2 tokens grown by the
Ledger, no engine). Browser tests drive Debian's chromium through Playwright; a machine without
it fails them with a message saying how to install it (``make test`` installs it).
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import view_runs
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.harness.store import RunManifest, TraceWriter
from verbatim.renderers.registry import get_renderer
from verbatim.view.server import make_server, serve_in_thread

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
runner = CliRunner()


@pytest.fixture(scope="module")
def renderer(default_model_dir):
    return get_renderer("smollm2", model_dir=default_model_dir)


@pytest.fixture(scope="module")
def train_run(tmp_path_factory, renderer, default_model_dir) -> Path:
    rollouts = view_runs.rollouts(renderer)
    return view_runs.write_run(tmp_path_factory.mktemp("view") / "run", renderer, str(default_model_dir),
                               [rollouts[:2], rollouts[2:]], metrics=view_runs.step_metrics(4),
                               trainer=rollouts[:1])


def serving(run_dir: Path):
    """A server on any free port, its background lint done (so the list's counts are there)."""
    server = make_server(run_dir, 0)
    assert server.RequestHandlerClass.data.wait_for_lint(120)
    serve_in_thread(server)
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(scope="module")
def site(train_run):
    server, url = serving(train_run)
    yield url
    server.shutdown()
    server.server_close()


def get(url: str) -> tuple[int, dict, object]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"null")


# ---------------------------------------------------------------------------
# The JSON endpoints (standard library only)
# ---------------------------------------------------------------------------


def test_summary_and_list_of_a_training_run(site):
    status, headers, summary = get(f"{site}/api/summary")
    assert status == 200
    policy = headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "unsafe" not in policy
    assert summary["training"] and [m["step"] for m in summary["metrics"]] == [0, 1, 2, 3]
    assert summary["totals"]["rollouts"] == 3 and not summary["partial"]
    _, _, listing = get(f"{site}/api/rollouts")
    rows = {row["id"]: row for row in listing["rows"]}
    assert set(rows) == {"g0-r0", "g0-r1", "g1-evil"}
    assert rows["g0-r0"]["misses"] == 1 and rows["g0-r1"]["misses"] == 0 and rows["g1-evil"]["status"] == "error"


def test_one_rollout_token_by_token(site, train_run, default_tokenizer):
    from verbatim.harness.store import read_run

    _, _, detail = get(f"{site}/api/rollout?id=g0-r0")
    original = next(r for r in read_run(train_run).rollouts if r.rollout_id == "g0-r0")
    ids = original.tokens.token_id.tolist()
    columns = detail["columns"]
    assert columns["id"] == ids
    assert "".join(columns["text"]).replace("↵", "\n") == default_tokenizer.decode(ids, skip_special_tokens=False)
    assert columns["text"][0] == "<|im_start|>" and columns["special"][0]
    missed = [t["index"] for t in detail["turns"] if t["miss"]]
    assert missed == [2]
    (problem,) = detail["problems"]
    assert problem["kind"] == "cache_shortfall" and problem["position"] == detail["turns"][2]["cached"] == 0
    assert columns["prefills"][10] == 2  # by turn 0, then again by the missed turn 2 (turn 1 had it cached)
    assert columns["prefills"][50] == 3  # past turn 1's cached blocks: every request computed it
    keep = detail["trainer"]["keep"]
    model = [k for k, s in enumerate(columns["source"]) if s == 2]
    assert any(keep[k] is False for k in model) and any(keep[k] for k in model)
    _, _, hybrid = get(f"{site}/api/rollout?id=g0-r1")
    assert any(hybrid["columns"]["hybrid"]) and hybrid["trainer"] is None


def test_group_is_aligned_on_its_shared_prefix(site):
    _, _, group = get(f"{site}/api/group?id=g0")
    first_prompt = group["members"][0]["first_prompt"]
    assert group["shared"] == first_prompt  # same question, different first answers
    assert [m["row"]["id"] for m in group["members"]] == ["g0-r0", "g0-r1"]
    assert group["members"][1]["first_cached"] > 0 and group["members"][0]["first_cached"] == 0


def test_unknown_ids_and_writes_are_refused(site):
    status, _, body = get(f"{site}/api/rollout?id=nope")
    assert status == 404 and "no rollout 'nope'" in body["error"]
    request = urllib.request.Request(f"{site}/api/summary", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 405


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:{port}", "127.0.0.1.attacker.example",
                                  "localhost:1", ""])
def test_a_request_for_another_host_name_is_refused(site, host):
    """DNS rebinding: a page on attacker.example that resolves to 127.0.0.1 sends its own name as Host."""
    port = site.rsplit(":", 1)[1]
    request = urllib.request.Request(f"{site}/api/summary", headers={"Host": host.format(port=port)})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 403
    for name in ("127.0.0.1", "localhost", f"localhost:{port}", f"[::1]:{port}"):
        with urllib.request.urlopen(urllib.request.Request(f"{site}/api/summary", headers={"Host": name}),
                                    timeout=10) as answered:
            assert answered.status == 200


def test_opening_reads_columns_and_lints_later_in_the_background(tmp_path, renderer, default_model_dir):
    from verbatim.harness.store import read_run
    from verbatim.harness.summary import summarize
    from verbatim.view.run_data import RunData

    rollouts = view_runs.rollouts(renderer)
    run = view_runs.write_run(tmp_path / "run", renderer, str(default_model_dir), [rollouts[:2]], status="running")
    data = RunData(run)
    summary, listing = data.summary(), data.rollout_list()  # the background pass starts after the first list
    assert summary["lint_pending"] and summary["lint_problems"] is None
    assert summary["totals"]["min_prefill_tokens"] is None
    assert [(r["id"], r["misses"], r["problems"]) for r in listing["rows"]] == [("g0-r0", None, None),
                                                                                ("g0-r1", None, None)]
    assert data.wait_for_lint(60)
    summary = data.summary()
    expected = summarize(read_run(run).rollouts, block_size=view_runs.BLOCK)
    for key in ("rollouts", "turns", "prompt_tokens", "cached_tokens", "prefill_tokens", "min_prefill_tokens",
                "generated_tokens", "statuses", "mean_reward"):
        assert summary["totals"][key] == getattr(expected, key), key
    assert not summary["lint_pending"] and summary["lint_problems"] == 1
    assert {r["id"]: r["misses"] for r in data.rollout_list()["rows"]} == {"g0-r0": 1, "g0-r1": 0}
    first = data._batches["rollouts-000001.parquet"]
    TraceWriter(run, RunManifest.model_validate_json((run / "manifest.json").read_text())).write_batch(rollouts[2:])
    rows = data.rollout_list()["rows"]
    assert data._batches["rollouts-000001.parquet"] is first  # an unchanged file is not read again
    assert [r["id"] for r in rows] == ["g0-r0", "g0-r1", "g1-evil"]
    assert data.rollout("g1-evil")["row"]["problems"] == data.rollout_list()["rows"][2]["problems"] is not None


def test_a_directory_that_is_not_a_run_is_one_line_exit_2(tmp_path):
    result = runner.invoke(app, ["view", str(tmp_path)])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "not a verbatim run" in lines[0], result.stderr


def test_a_half_written_run_shows_what_is_intact(tmp_path, renderer, default_model_dir):
    run = view_runs.write_run(tmp_path / "run", renderer, str(default_model_dir),
                              [view_runs.rollouts(renderer)[:2]], status="running")
    (run / "rollouts-000002.parquet").write_bytes(b"PAR1 torn")
    (run / ".tmp-rollouts-000003.parquet").write_bytes(b"")
    server, url = serving(run)
    try:
        _, _, summary = get(f"{url}/api/summary")
    finally:
        server.shutdown()
        server.server_close()
    assert summary["partial"] and summary["rollouts"] == 2 and not summary["training"]
    assert any("rollouts-000002.parquet" in p for p in summary["problems"])
    assert any("unfinished write" in p for p in summary["problems"])


def test_static_file_embeds_the_run_inertly(train_run, tmp_path):
    out = tmp_path / "run.html"
    result = runner.invoke(app, ["view", str(train_run), "--static", str(out)])
    assert result.exit_code == 0, result.stderr
    page = out.read_text()
    assert 'http-equiv="Content-Security-Policy"' in page and "script-src 'sha256-" in page
    assert "<img src=x" not in page and "</script><script>window" not in page  # trace text is escaped JSON
    assert "\\u003cimg src=x onerror" in page and "/static/" not in page


# ---------------------------------------------------------------------------
# In a real browser
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium; "
                    "'make test' does it)", pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(10_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.errors = errors
    yield page
    context.close()


def open_page(page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']")


@pytest.mark.slow
def test_click_through_run_rollout_colouring_group(page, site):
    open_page(page, site)
    assert page.locator(".chart[data-chart='reward'] circle.point").count() == 4 + 2  # and the evaluations'
    assert page.locator(".chart[data-chart='reward'] g[data-series='held-out'] circle.point").count() == 2
    assert page.locator(".chart[data-chart='policy entropy (nats)'] circle.point").count() == 4
    assert page.locator("#list-count").inner_text() == "3 of 3 rollouts"
    page.select_option("#f-lint", "misses")
    assert page.locator("#list-count").inner_text() == "1 of 3 rollouts"
    page.click(".row[data-id='g0-r0'] .c-id")
    page.wait_for_selector("#tokens .tok")
    _, _, detail = get(f"{site}/api/rollout?id=g0-r0")
    cells = page.locator("#tokens .tok")
    positions = [int(p) for p in cells.evaluate_all("cs => cs.map(c => c.dataset.pos)")]
    assert positions == list(range(len(detail["columns"]["text"])))
    assert cells.evaluate_all("cs => cs.map(c => c.textContent)") == detail["columns"]["text"]
    assert page.locator("#tokens .tok.src-0").count() and page.locator("#tokens .tok.src-2").count()
    miss = page.locator(".turn[data-turn='2']")
    assert "miss" in miss.get_attribute("class") and "CACHE MISS" in miss.inner_text()
    assert "miss" not in page.locator(".turn[data-turn='1']").get_attribute("class")
    assert page.locator(".tok.pinned").evaluate_all("cs => cs.map(c => c.dataset.pos)") == ["0"]
    page.select_option("#mode", "logprob")
    assert page.locator("#tokens .tok[class*='lp-']").count() == detail["columns"]["source"].count(2)
    page.select_option("#mode", "mask")
    assert page.locator("#tokens .tok.masked").count() and page.locator("#tokens .tok.keep").count()
    page.select_option("#mode", "routing")  # a MoE's tokens routed elsewhere by the trainer (mismatch --save)
    flipped = [f for f in detail["trainer"]["flips"] if f > 0]
    assert page.locator("#tokens .tok[class*='flip-']").count() == len(flipped) > 0
    assert page.locator("#tokens .tok.flip-2").count() == flipped.count(2) > 0
    page.click("nav .crumb a")
    page.wait_for_selector("#members .member")
    assert page.locator("#members .member").evaluate_all("ms => ms.map(m => m.dataset.id)") == ["g0-r0", "g0-r1"]
    assert "49 tokens shared by all 2 members" in page.locator("#prefix").inner_text()
    page.click(".member[data-id='g0-r1'] h3 a")
    page.select_option("#mode", "version")
    assert page.locator("#tokens .tok.hybrid").count() > 0
    assert page.errors == []


@pytest.mark.slow
def test_hostile_trace_text_never_runs(page, site, train_run, tmp_path):
    open_page(page, f"{site}/#/rollout/g1-evil")
    page.wait_for_selector("#tokens .tok")
    body = page.locator("body").inner_text()
    assert "env said <img src=x onerror" in body and "</script><script>window.__pwned=2</script>" in body
    assert page.evaluate("window.__pwned") is None and page.locator("img").count() == 0
    _, _, detail = get(f"{site}/api/rollout?id=g1-evil")
    assert any("<" in text for text in detail["columns"]["text"])
    shown = page.locator("#tokens .tok").evaluate_all("cs => cs.map(c => c.textContent)")
    assert shown == detail["columns"]["text"]  # each token's text as text, markup and all
    out = tmp_path / "run.html"
    assert runner.invoke(app, ["view", str(train_run), "--static", str(out)]).exit_code == 0
    open_page(page, out.as_uri())
    page.click(".row[data-id='g1-evil'] .c-id")
    page.wait_for_selector("#tokens .tok")
    assert "env said <img src=x onerror" in page.locator("body").inner_text()
    assert page.evaluate("window.__pwned") is None and page.locator("img").count() == 0
    assert page.errors == []


@pytest.mark.slow
def test_a_run_being_written_updates_the_page(page, tmp_path, renderer, default_model_dir):
    rollouts = view_runs.rollouts(renderer)
    run = view_runs.write_run(tmp_path / "run", renderer, str(default_model_dir), [rollouts[:1]], status="running")
    server, url = serving(run)
    try:
        open_page(page, url)
        assert "partial run: status running, 1 rollouts so far" in page.locator("#partial").inner_text()
        writer = TraceWriter(run, RunManifest.model_validate_json((run / "manifest.json").read_text()))
        writer.write_batch(rollouts[1:])
        writer.write_manifest(writer.manifest.model_copy(update={"status": "completed"}))
        from playwright.sync_api import expect

        expect(page.locator("#list-count")).to_have_text("3 of 3 rollouts")
        expect(page.locator("#partial")).to_be_hidden()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
@pytest.mark.slow
def test_a_history_break_shows_where_the_new_segment_opens(page, tmp_path, renderer, default_model_dir):
    rollout = view_runs.segmented(renderer)
    pieces = rollout.segments()
    run = view_runs.write_run(tmp_path / "agent", renderer, str(default_model_dir), [[rollout]])
    import dataclasses

    from verbatim.trainer.logprob_files import step_file, write_logprobs

    rows = [dataclasses.replace(view_runs.trainer_logprobs(piece), rollout_id=piece.row_id) for piece in pieces]
    write_logprobs(step_file(run, 0), rows, {"writer": "train", "step": 0, "trainer_version": 0})
    server, url = serving(run)
    try:
        _, _, detail = get(f"{url}/api/rollout?id=a0-r0")
        assert [t["opens_segment"] for t in detail["turns"]] == [False, False, True]
        assert detail["trainer"] is not None and len(detail["trainer"]["keep"]) == len(rollout.tokens)
        open_page(page, url)
        page.click(".row[data-id='a0-r0'] .c-id")
        page.wait_for_selector("#tokens .tok")
        opened = page.locator(".turn.break")
        assert opened.count() == 1 and opened.get_attribute("data-turn") == "2"
        assert "HISTORY BREAK · segment 1" in opened.inner_text() and "message 0 (user)" in opened.inner_text()
        assert "break" not in page.locator(".turn[data-turn='1']").get_attribute("class")
        pinned = page.locator(".tok.pinned").evaluate_all("cs => cs.map(c => c.dataset.pos)")
        assert str(len(pieces[0].tokens)) in pinned  # the history_break, pinned where the segment opens
        page.select_option("#mode", "mask")
        assert page.locator("#tokens .tok.masked").count() and page.locator("#tokens .tok.keep").count()
        assert page.errors == []
    finally:
        server.shutdown()
        server.server_close()


def test_chromium_is_debians(browser):
    """The browser the tests drive is the system's, never one Playwright downloaded."""
    assert Path(CHROMIUM).resolve().is_file() and shutil.which("chromium")
    assert browser.version


def test_bench_view_times_a_synthetic_run_into_its_doc_section(tmp_path):
    doc = tmp_path / "bench.md"
    doc.write_text("# prose\n<!-- bench-view:begin -->\nold\n<!-- bench-view:end -->\nafter\n")
    result = runner.invoke(app, ["bench", "view", "--rollouts", "17", "--long-tokens", "2000", "--write", str(doc)])
    assert result.exit_code == 0, result.stderr
    text = doc.read_text()
    assert text.startswith("# prose\n") and text.endswith("after\n") and "old" not in text
    assert "synthetic run of 17 rollouts" in text and "one of them 2,000 tokens long" in text
    assert "| open: summary + rollout list (first page) |" in text and "Machine (detected):" in text
