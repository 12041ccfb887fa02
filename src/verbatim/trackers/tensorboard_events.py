"""TensorBoard: event files in ``RUN_DIR/tensorboard``, written with TensorBoard's own event writer and
protos (no TensorFlow, no torch): a scalar per metric and step, the rollout table and the config as text
(its text plugin renders Markdown). ``tensorboard --logdir RUN_DIR/tensorboard`` shows them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.compat.proto.types_pb2 import DT_STRING
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from verbatim.trackers.records import TABLE, markdown_table

FOLDER = "tensorboard"


def _text(tag: str, markdown: str) -> Summary.Value:
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
    tensor = TensorProto(dtype=DT_STRING, string_val=[markdown.encode("utf-8")],
                         tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
    return Summary.Value(tag=tag, metadata=metadata, tensor=tensor)


class TensorBoardRun:
    name = "tensorboard"

    def __init__(self, folder: Path, config: dict[str, Any]) -> None:
        self.writer = EventFileWriter(str(folder))
        config_text = "```json\n" + json.dumps(config, indent=1, sort_keys=True, default=str) + "\n```"
        self._write(0, [_text("config", config_text)])

    def _write(self, step: int, values: list[Summary.Value]) -> None:
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def log(self, step: int, metrics: dict[str, float], rollouts: list[list[Any]]) -> None:
        values = [Summary.Value(tag=name, simple_value=value) for name, value in metrics.items()]
        if rollouts:
            values.append(_text(TABLE, markdown_table(rollouts)))
        self._write(step, values)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_run(run_dir: Path, config: dict[str, Any]) -> TensorBoardRun:
    folder = run_dir / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    return TensorBoardRun(folder, config)
