"""Coverage-guided fuzz targets (atheris, i.e. libFuzzer over Python bytecode coverage).

Run as a script, one target per process (atheris never returns from ``Fuzz``):

    python tests/fuzz_targets.py TARGET CORPUS_DIR -runs=4000 -seed=1 -timeout=10

Targets: ``completion:<renderer family>`` (``parse_completion`` on tokens made from the
input: text with format markup encoded by the renderer's tokenizer, raw in-vocabulary ids,
a stop token), ``jsonl`` (one trace line), ``parquet`` (a batch file in a run directory),
``tasks`` (a task file, then each task validated as the python and guess envs' tasks).

Each target may refuse its input only with verbatim's own errors (``VerbatimError``) or
report it as data; any other exception is a crash: libFuzzer writes the input under
``-artifact_prefix`` and the process exits non-zero (``tests/test_fuzz_coverage.py``).
``python tests/fuzz_targets.py --seed TARGET CORPUS_DIR`` writes one valid input for a target.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import atheris
from fakes import PARSER_MARKUP, tiny_rollout  # tests/ is this script's folder, first on sys.path

with atheris.instrument_imports(include=["verbatim"]):
    from verbatim.datamodel import Message
    from verbatim.envs.guess import GuessTask
    from verbatim.envs.python import PythonTask
    from verbatim.envs.taskfile import load_tasks, parse_task
    from verbatim.errors import VerbatimError
    from verbatim.harness.store import RunManifest, TraceWriter, read_run
    from verbatim.harness.tracefile import from_json_line, to_json_line
    from verbatim.renderers.registry import get_renderer



def completion_target(family: str):
    from verbatim.engine.models import prepare

    renderer = get_renderer(family, model_dir=prepare())
    size, stops = len(renderer.tokenizer), list(renderer.stop_token_ids)

    def target(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        pieces = [PARSER_MARKUP[fdp.ConsumeIntInRange(0, len(PARSER_MARKUP) - 1)] if fdp.ConsumeBool()
                  else fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 16))
                  for _ in range(fdp.ConsumeIntInRange(0, 10))]
        ids = list(renderer.tokenizer.encode("".join(pieces), add_special_tokens=False))
        ids += fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 6), 0, size - 1)
        if stops and fdp.ConsumeBool():
            ids.append(stops[0])
        try:
            message = renderer.parse_completion(ids)
        except VerbatimError:
            return
        if not isinstance(message, Message) or message.role != "assistant":
            raise AssertionError(f"parse_completion returned {message!r}")

    return target


def jsonl_target(data: bytes) -> None:
    try:
        from_json_line(data.decode("utf-8", errors="replace"))
    except VerbatimError:
        pass


def _run_dir_target(name: str):
    folder = Path(tempfile.mkdtemp(prefix="verbatim-atheris-"))
    TraceWriter(folder, RunManifest(run_id="fuzz", format="parquet"))

    def target(data: bytes) -> None:
        (folder / name).write_bytes(data)
        try:
            trace = read_run(folder)
        except VerbatimError:
            return
        if any("\n" in problem for problem in trace.problems):
            raise AssertionError(f"a problem of more than one line: {trace.problems}")

    return target


def tasks_target():
    path = Path(tempfile.mkdtemp(prefix="verbatim-atheris-"), "tasks.jsonl")

    def target(data: bytes) -> None:
        path.write_bytes(data)
        try:
            tasks = load_tasks(path)
        except VerbatimError:
            return
        for task in tasks:
            for spec in (PythonTask, GuessTask):
                try:
                    parse_task(spec, task, "fuzz")
                except VerbatimError:
                    pass

    return target


def make_target(name: str):
    if name.startswith("completion:"):
        return completion_target(name.split(":", 1)[1])
    if name == "jsonl":
        return jsonl_target
    if name == "parquet":
        return _run_dir_target("rollouts-000001.parquet")
    if name == "tasks":
        return tasks_target()
    raise SystemExit(f"unknown fuzz target {name!r}")


def seed_corpus(name: str, corpus: Path) -> None:
    """One valid input for ``name`` in ``corpus``, so that mutations start from a real file."""
    corpus.mkdir(parents=True, exist_ok=True)
    rollout = tiny_rollout()
    if name == "jsonl":
        (corpus / "line").write_text(to_json_line(rollout))
    elif name == "parquet":
        folder = Path(tempfile.mkdtemp(prefix="verbatim-atheris-seed-"))
        path = TraceWriter(folder, RunManifest(run_id="fuzz")).write_batch([rollout])
        (corpus / "batch").write_bytes(path.read_bytes())
    elif name == "tasks":
        lines = [{"id": "t1", "prompt": "print(1)", "expected": "1"}, {"target": 7, "low": 1, "high": 10}]
        (corpus / "tasks").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    else:
        (corpus / "tokens").write_bytes(bytes(range(64)))


if __name__ == "__main__":
    if sys.argv[1] == "--seed":
        seed_corpus(sys.argv[2], Path(sys.argv[3]))
        raise SystemExit(0)
    target_name, *libfuzzer_args = sys.argv[1:]
    with atheris.instrument_imports(include=["verbatim"]):  # the renderer families are imported lazily
        fuzz_one = make_target(target_name)
    atheris.Setup([sys.argv[0], *libfuzzer_args], fuzz_one)
    atheris.Fuzz()
