"""TensorBoard event files beside metrics.jsonl (``output.tensorboard``): the scalars of every
step and validation, and the samples as text.  Written with TensorBoard's own event writer and
protobuf classes (``pip install 'pytrain[tensorboard]'``), so any TensorBoard reads them:
``tensorboard --logdir runs/`` shows each run folder as a run."""
from __future__ import annotations

import math
import time
from pathlib import Path

from pytrain.run.callbacks import Callback
from pytrain.run.folder import run_file

# metrics.jsonl keys shown as scalars (the rewards of preference runs too)
SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "accuracy", "perplexity", "drift",
           "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "nll_loss", "log_odds_ratio")
# EventFileWriter's names: events.out.tfevents.TIME.HOST.PID.N
EVENTS = run_file("events.out.tfevents.*", "TensorBoard's event files (output.tensorboard)")
MISSING = "output.tensorboard = true needs TensorBoard: pip install 'pytrain[tensorboard]'"


def available() -> str | None:
    """None when TensorBoard's writer imports, else what to install."""
    try:
        import tensorboard.summary.writer.event_file_writer  # noqa: F401
    except ImportError:
        return MISSING
    return None


class TensorBoard(Callback):
    """``resume_step``: a resumed run's first step; TensorBoard drops what earlier event files
    hold from there on (a ``SessionLog.START`` purge, as ``SummaryWriter(purge_step=)``)."""

    def __init__(self, folder: Path, resume_step: int | None = None) -> None:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        self._pb = event_pb2
        self.writer = EventFileWriter(str(folder))
        if resume_step is not None:
            self._add(event_pb2.Event(step=resume_step, wall_time=time.time(),
                                      session_log=event_pb2.SessionLog(
                                          status=event_pb2.SessionLog.START)))

    def _add(self, event) -> None:
        self.writer.add_event(event)

    def _summary(self, step: int, values: list) -> None:
        from tensorboard.compat.proto import summary_pb2
        self._add(self._pb.Event(step=step, wall_time=time.time(),
                                 summary=summary_pb2.Summary(value=values)))

    def on_record(self, rec: dict) -> None:
        from tensorboard.compat.proto import summary_pb2
        if "step" not in rec or ("loss" not in rec and rec.get("split") != "valid"):
            return
        split = "valid" if rec.get("split") == "valid" else "train"
        values = [summary_pb2.Summary.Value(tag=f"{split}/{k}", simple_value=float(rec[k]))
                  for k in SCALARS if isinstance(rec.get(k), (int, float))
                  and math.isfinite(rec[k])]
        if values:
            self._summary(rec["step"], values)

    def on_samples(self, step: int, samples: list[dict]) -> None:
        from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2
        from tensorboard.plugins.text import plugin_data_pb2
        meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name="text",
            content=plugin_data_pb2.TextPluginData(version=0).SerializeToString()))
        values = []
        for i, s in enumerate(samples):
            text = f"**prompt**\n\n    {_indent(s['prompt'])}\n\n**completion**\n\n    " \
                   f"{_indent(s['completion'])}"
            tensor = tensor_pb2.TensorProto(
                dtype="DT_STRING", string_val=[text.encode()],
                tensor_shape=tensor_shape_pb2.TensorShapeProto(
                    dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]))
            values.append(summary_pb2.Summary.Value(tag=f"samples/{i}", metadata=meta,
                                                    tensor=tensor))
        self._summary(step, values)

    def close(self) -> None:
        self.writer.close()


def _indent(text: str) -> str:
    """As a Markdown code block (TensorBoard renders text as Markdown): kept verbatim."""
    return text.replace("\n", "\n    ")
