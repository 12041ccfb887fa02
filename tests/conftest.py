"""Shared fixtures. Nothing may download from a model hub: HF_HUB_OFFLINE=1 throughout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

REPO = Path(__file__).resolve().parent.parent

# No example has a time limit: the suite shares two cores between its workers and the engines, and a stalled
# example is not a failure (timings are the benchmarks' business, not the tests').
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

# Tests keep verbatim's files (converted model, vLLM caches) inside the checkout, so
# a fresh clone converts the bundled model once per test session and reuses it after.
os.environ.setdefault("VERBATIM_HOME", str(REPO / ".cache" / "test-home"))


class EngineStarts:
    """Every vLLM engine the suite starts, in this process or any it launched: the engine appends a line to the
    file ``$VERBATIM_ENGINE_STARTS`` names (engine/start_log.py); each test is charged the lines that appeared
    while it ran (with its fixtures' set-up), and the run's summary names the count and who started them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen = 0
        self.by_test: dict[str, list[str]] = {}

    def charge(self, nodeid: str) -> None:
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        if len(lines) > self.seen:
            self.by_test[nodeid] = [line.split(" ", 1)[0] for line in lines[self.seen:]]
            self.seen = len(lines)

    def report(self, write) -> None:
        """The count, then who started them (xdist's group suffix left off the test's name)."""
        kinds = [kind for started in self.by_test.values() for kind in started]
        counts = ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds)))
        write(f"vLLM engines started: {len(kinds)}" + (f" ({counts})" if kinds else ""))
        for nodeid, started in sorted(self.by_test.items(), key=lambda item: -len(item[1])):
            write(f"  {len(started)}  {nodeid.partition('@')[0]}")


class MemoryPeaks:
    """The suite process's own peak resident memory (``VmHWM``), charged to the test during which it rose: the
    summary names the tests that raised it most, since this process shares the machine with every engine."""

    def __init__(self) -> None:
        self.peak = self.now()
        self.by_test: dict[str, int] = {}

    @staticmethod
    def now() -> int:
        """This process's peak resident memory so far, in MiB (0 where /proc does not say)."""
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) // 1024
        except OSError:
            pass
        return 0

    def charge(self, nodeid: str) -> None:
        peak = self.now()
        if peak > self.peak:
            self.by_test[nodeid] = peak - self.peak
            self.peak = peak

    def merge(self, peak: int, by_test: dict[str, int]) -> None:
        """A worker's record (under xdist): the summary names the largest of the suite's processes' peaks."""
        self.peak = max(self.peak, peak)
        self.by_test.update(by_test)

    def report(self, write, shown: int = 8) -> None:
        write(f"the suite process's peak resident memory: {self.peak} MiB; the tests that raised it most:")
        for nodeid, grown in sorted(self.by_test.items(), key=lambda item: -item[1])[:shown]:
            write(f"  +{grown} MiB  {nodeid.partition('@')[0]}")


def _a_core_of_its_own() -> None:
    """An xdist worker (``make test``: two) and every process it starts run on one core of their own, with one
    OpenMP thread, where the machine has a core per worker. Each worker runs engine tests (its group), and an
    engine or trainer whose two OpenMP threads share two cores with another worker's spins and waits on a
    descheduled thread: test_prefixflow_default_model took 307 s beside the other group instead of 33 s alone
    (a fresh-clone run of dbccf01), while a test on one core of its own takes about 1.2 times its two-core time
    (test_engine's cache policies: 53 s against 44 s) with 0.73 times the CPU time."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 0))
    cpus = sorted(os.sched_getaffinity(0))
    if count < 2 or len(cpus) < count or not worker.startswith("gw"):
        return
    core = {cpus[int(worker[2:])]}  # gw0, gw1, …: fewer workers than cores (above)
    for task in os.listdir("/proc/self/task"):  # every thread this worker has now; later ones inherit
        os.sched_setaffinity(int(task), core)
    os.environ["OMP_NUM_THREADS"] = "1"


def pytest_configure(config) -> None:
    import tempfile

    _a_core_of_its_own()

    from verbatim.engine.start_log import STARTS_ENV

    folder = Path(tempfile.mkdtemp(prefix="verbatim-engine-starts-"))
    os.environ[STARTS_ENV] = str(folder / "starts.txt")  # inherited by every process a test starts
    config.engine_starts = EngineStarts(folder / "starts.txt")
    config.memory_peaks = MemoryPeaks()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    item.config.engine_starts.charge(item.nodeid)
    item.config.memory_peaks.charge(item.nodeid)


@pytest.hookimpl(tryfirst=True)  # before xdist sends a worker's output to the controller
def pytest_sessionfinish(session) -> None:
    config = session.config
    if hasattr(config, "workeroutput"):  # an xdist worker: its record goes to the controller's summary
        config.engine_starts.charge("(after the last test: teardown)")
        config.workeroutput["engine_starts"] = config.engine_starts.by_test
        config.workeroutput["memory"] = (config.memory_peaks.peak, config.memory_peaks.by_test)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """An xdist worker's engine starts and memory, into the controller's summary."""
    output = getattr(node, "workeroutput", {})
    node.config.engine_starts.by_test.update(output.get("engine_starts", {}))
    if "memory" in output:
        node.config.memory_peaks.merge(*output["memory"])


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    config.engine_starts.charge("(after the last test: teardown)")
    terminalreporter.write_sep("=", "engine starts")
    config.engine_starts.report(terminalreporter.write_line)
    terminalreporter.write_sep("=", "memory")
    config.memory_peaks.report(terminalreporter.write_line)


@pytest.fixture(scope="module", autouse=True)
def _memory_back_after_each_module():
    """After each module, what its tests freed goes back to the system: the models, optimizers and engines the
    tests load in this process leave glibc's heap fragmented, and the suite's process grew to ~8 GB, beside the
    session's engine and test_train_procs' ranks and engine (two fresh-clone runs were OOM-killed there)."""
    yield
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        pass


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The bundled default model, converted from its GGUF (once per cache dir)."""
    from verbatim.engine.models import prepare

    return prepare()


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors gain nothing from threads; on a shared CPU a descheduled thread stalls every op."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def demo_python(tmp_path_factory) -> Path:
    """An interpreter that imports only what ``make demo``'s virtualenv holds (tests/demo_fence.py)."""
    import demo_target
    from demo_fence import fenced_python

    return fenced_python(tmp_path_factory.mktemp("demo-env"), demo_target.fence())


@pytest.fixture(scope="session")
def chat_templates_dir() -> Path:
    """The official templates and tokenizer files that the package ships."""
    from verbatim.paths import chat_templates_dir

    return chat_templates_dir()


class EngineRunner:
    """One real engine for the whole session, driven from a private event loop thread."""

    def __init__(self, engine) -> None:
        import asyncio
        import threading

        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 300.0):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.engine.close()
        import concurrent.futures

        try:  # what the engine left on the loop ends here, not as "Task was destroyed but it is pending!"
            self.run(_cancel_the_rest(), timeout=30)
        except concurrent.futures.TimeoutError:
            pass  # a task that ignores its cancellation: stop the loop all the same
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


async def _cancel_the_rest() -> None:
    import asyncio

    rest = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)


@pytest.fixture(scope="session")
def session_engine(default_model_dir: Path):
    """The bundled vLLM engine on the default model (fp32, prefix caching on), one for the whole session; a run
    given it (``run_training(..., engine=)``) begins it with its own weights."""
    from verbatim.engine.inproc import InprocEngine
    from verbatim.engine.runtime import EngineConfig

    engine = InprocEngine(EngineConfig(model=str(default_model_dir), kv_cache_gib=1, max_model_len=4096))
    runner = EngineRunner(engine)
    runner.run(engine.start())
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def lora_engine(default_model_dir: Path):
    """An engine started for LoRA adapters up to rank 8 (tests/test_lora_engine.py), which the session's engine is
    not: the engine tests' group starts it after the session's servers have stopped."""
    from verbatim.engine.inproc import InprocEngine
    from verbatim.engine.runtime import EngineConfig

    engine = InprocEngine(EngineConfig(model=str(default_model_dir), kv_cache_gib=1, max_model_len=2048,
                                       lora_rank=8, lora_slots=4))
    runner = EngineRunner(engine)
    runner.run(engine.start())
    yield runner
    runner.close()


@pytest.fixture
def engine_runner(session_engine, default_model_dir: Path):
    """The session's engine as a test finds it: the base weights as version 0 and an empty prefix cache
    (``Engine.begin`` from the serving copy it started from, untied already), whatever the tests before it left
    there."""
    engine = session_engine.engine
    session_engine.run(engine.begin(str(engine.serving_dir), 0))
    return session_engine


SERVER_BLOCK_SIZE = 64
"""The session server's KV block size: not the default (32), so that a client which assumed the default instead of
learning the server's would be caught (tests/test_engine_http.py) without a server of its own."""


def _serve(model_dir: Path, folder: Path):
    """A real ``vllm serve`` of ``model_dir``, stopped when the block ends."""
    from verbatim.engine.runtime import EngineConfig
    from verbatim.engine.server import ServerProcess

    config = EngineConfig(model=str(model_dir), kv_cache_gib=1, max_model_len=2048, block_size=SERVER_BLOCK_SIZE)
    return ServerProcess(config, log_path=folder / "serve.log")


class SharedServer:
    """One ``vllm serve`` for every test that takes the fixture ``fixture``: started by the first, started again
    only after a test killed it (that death is the test's subject), and stopped once the last of them has run
    (:func:`pytest_runtest_teardown`), so that its ~3.5 GB are free for the tests after it (the router's replicas,
    the trainer teams)."""

    def __init__(self, fixture: str) -> None:
        self.fixture = fixture
        self.server = None
        self.last_user: pytest.Item | None = None

    def users(self, items: list[pytest.Item]) -> list[pytest.Item]:
        return [item for item in items if self.fixture in getattr(item, "fixturenames", ())]

    def get(self, model_dir: Path, folder_of) -> object:
        if self.server is not None and self.server.proc.poll() is not None:
            self.stop()  # a test killed it
        if self.server is None:
            self.server = _serve(model_dir, folder_of()).__enter__()
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            server.__exit__(None, None, None)


SHARED_SERVER = SharedServer("vllm_server")
TINY_SERVER = SharedServer("tiny_server")
SERVERS = (SHARED_SERVER, TINY_SERVER)
"""In the order their users run: one server at a time."""


def _server_rank(item: pytest.Item) -> int:
    return next((n for n, shared in enumerate(SERVERS) if shared.users([item])), len(SERVERS))


SESSION_GROUP, SERVER_GROUP = "session-engine", "server"
"""The two xdist groups (``make test`` runs ``-n 2 --dist loadgroup``): each runs its tests one after another in
one worker, the two beside each other. The first holds the tests on this process's session engine
(``session_engine``) and the engines they start in-process; the second the tests on the session's ``vllm serve``
servers (``vllm_server``, ``tiny_server``), the other engine tests (their engines run in processes they start)
and the modules of :data:`SERVER_MODULES`, whose processes take GBs. Within a group one test runs at a time;
the rest, pure logic, run in either worker once its group is done."""
SESSION_MODULES = frozenset({"test_prefixflow_default_model", "test_train_families", "test_engine_start_failure",
                             "test_engine_dtype"})
"""Engine tests beside the session engine's users, for balance (the server group's tests took 979 s and this
group's 909 s, the rest 466 s, in a fresh-clone run of 523c1d6, test_engine_dtype's 35 s among the server's);
test_prefixflow_default_model runs first of its group, before the
session engine (~3 GB) and the in-process trainers (up to ~8 GB) are there, since its process alone takes
~10 GB."""
SERVER_MODULES = frozenset({"test_trainer_distributed", "test_bench_train_scale", "test_bench_train_step"})
FIRST = "test_prefixflow_default_model"
ONE_WORKER_MODULES = frozenset({"test_models_tiny"})
"""Modules of pure logic whose module fixture is costly (every tiny family's folder, Gemma's 262k vocabulary
among them: 28 s): a group of their own keeps their tests in one worker, so it is built once (spread over both
workers, each built it: a fresh-clone run of 9105b93)."""


def xdist_group(item: pytest.Item) -> str | None:
    """The group of a test, or None for a test of pure logic that either worker may run."""
    if "session_engine" in getattr(item, "fixturenames", ()) or item.path.stem in SESSION_MODULES:
        return SESSION_GROUP
    if item.get_closest_marker("engine") or item.path.stem in SERVER_MODULES:
        return SERVER_GROUP
    if item.path.stem in ONE_WORKER_MODULES:
        return item.path.stem
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist names each test by its group
def pytest_collection_modifyitems(session, config, items) -> None:
    """The tests that kill the session's server run after every other test that uses it (one start, not a
    second after the kill); the last of them stops it. :data:`FIRST` runs first in its group, and
    :data:`SERVER_MODULES` (tiny models of their own) first in theirs: the bundled model is converted once, by
    whichever worker asks first (~25 s), and the other worker would wait for it with nothing to do. Then each
    server's users in the order of :data:`SERVERS`, so that one server runs at a time and none is left when the
    router's replicas start. Each test of a group is marked with it."""
    grouping = bool(config.getoption("loadgroup", default=False))  # an xdist worker under --dist loadgroup
    items.sort(key=lambda item: (item.path.stem != FIRST, item.path.stem not in SERVER_MODULES, _server_rank(item)))
    for item in items:
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            if grouping and hasattr(item, "_id"):
                _name_group(item, group)
    killers = [item for item in items if item.get_closest_marker("kills_server")]
    users = [item for item in SHARED_SERVER.users(items) if item not in killers]
    if killers and users:
        for item in killers:
            items.remove(item)
        at = items.index(users[-1]) + 1
        items[at:at] = killers
    for shared in SERVERS:
        everyone = shared.users(items)
        shared.last_user = everyone[-1] if everyone else None


def _name_group(item: pytest.Item, group: str) -> None:
    """What xdist 3.8 does for a test of a group, for pytest 9, whose node ids it no longer reaches (it sets
    ``_nodeid``, which pytest 9 does not read): the scheduler sends every test named ``…@group`` to one worker."""
    from _pytest.nodeid import coerce_node_id

    item._id = coerce_node_id(f"{item.nodeid}@{group}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    for shared in SERVERS:
        if item is shared.last_user or nextitem is None:
            shared.stop()


def _begun(shared: SharedServer, model_dir: Path, folder_of) -> object:
    """``shared``'s server serving ``model_dir``, begun as a test finds it: those weights as version 0 and an empty
    prefix cache (``HttpEngine.begin``), whatever the tests before it left there."""
    import asyncio

    from verbatim.engine.http import HttpEngine

    server = shared.get(model_dir, folder_of)

    async def reset() -> None:
        async with HttpEngine(server.url) as engine:
            await engine.begin(str(model_dir), 0)

    asyncio.run(reset())
    return server


@pytest.fixture
def vllm_server(default_model_dir, tmp_path_factory):
    """The session's ``vllm serve`` of the default model (:func:`_begun`)."""
    return _begun(SHARED_SERVER, default_model_dir, lambda: tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="session")
def tiny_smollm2_dir(tmp_path_factory) -> Path:
    """``verbatim models tiny smollm2``: the default model's architecture, tied output layer, tokenizer and
    template, with 2 layers of width 64 (13 MB of weights instead of 540 MB)."""
    from verbatim.harness.tiny_models import write_tiny_model

    return write_tiny_model("smollm2", tmp_path_factory.mktemp("tiny") / "smollm2", seed=0)


@pytest.fixture
def tiny_server(tiny_smollm2_dir, tmp_path_factory):
    """The session's ``vllm serve`` of the tiny SmolLM2 (:func:`_begun`), for the tests whose subject is the trainer's
    processes (kills, resumes, ranks), not the model: each of their steps trains, checkpoints and pushes 13 MB, not
    the default model's 540 MB (a 3-step run of two ranks: 22 s instead of 96 s on one core). Its folder is
    ``tiny_server.config.model``."""
    return _begun(TINY_SERVER, tiny_smollm2_dir, lambda: tmp_path_factory.mktemp("serve-tiny"))


