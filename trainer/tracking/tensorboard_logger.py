"""TensorBoard event files on rank 0, written with the `tensorboard` package (extra
`tensorboard`; no TensorFlow).

Scalars are the scalars plugin's own summaries (`scalar_pb`), which TensorBoard stores as
float32: every value is metrics.jsonl's rounded to float32 (TensorBoard's default loader
shows no other dtype; metrics.jsonl keeps full precision). Text samples go to the text
plugin. Each launch appends a new event file to the same directory, which TensorBoard reads
as one run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainer.tracking.records import RecordSink


class TensorboardSink(RecordSink):
    """One event per record, flushed at once: a crash loses nothing metrics.jsonl has.

    Args:
        logdir: the run's event directory (the same one on every launch of the run).
        sent_through: steps up to this one are already in `logdir` (written by the launch
            this one resumes: the records metrics.jsonl moved to metrics.superseded.jsonl);
            they are not written again, so every step has one value.
    """

    def __init__(self, logdir: Path, sent_through: int | None = None) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir = logdir
        self.sent_through = sent_through
        self.writer = EventFileWriter(str(logdir))

    def write(self, record: dict[str, Any]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.scalar import summary_v2 as scalar_summary
        from tensorboard.plugins.text import summary_v2 as text_summary

        step = int(record["step"])
        if self.sent_through is not None and step <= self.sent_through:
            return
        summary = summary_pb2.Summary()
        for key, value in record.items():
            if key == "step":
                continue
            if isinstance(value, str):
                summary.value.extend(text_summary.text_pb(key, value).value)
            elif isinstance(value, int | float):  # bool is an int: 0 / 1
                summary.value.extend(scalar_summary.scalar_pb(key, value).value)
        if summary.value:
            self.writer.add_event(
                event_pb2.Event(wall_time=time.time(), step=step, summary=summary)
            )
            self.writer.flush()

    def closing_note(self) -> str | None:
        return f"  TensorBoard: tensorboard --logdir {self.logdir}"

    def close(self) -> None:
        self.writer.close()
