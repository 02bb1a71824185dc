"""Metrics sinks: JSONL (the record of truth), TensorBoard, optional extra sinks (Weights &
Biases, ``rl_jax.wandb_log``), and a PNG of the curves.

``metrics.jsonl`` holds one JSON object per line with ``"step"``; on resume, lines past the
restored step are dropped (rewritten atomically) so a rerun never duplicates a step.

A ``gs://`` workdir (``rl_jax.storage``) cannot append to an object: the writer keeps the
file's lines and uploads the whole file at most every ``upload_every_s`` seconds, at every
``flush()`` (the trainer flushes before each checkpoint, so the rows of a saved step are
never missing) and at ``close()``; TensorBoard events go to a local folder that is uploaded
at ``flush()``/``close()``.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import tempfile
import time
from typing import Any, Mapping, Sequence

from etils import epath

from rl_jax import storage

__all__ = ["MetricsWriter", "read_jsonl", "truncate_after", "plot_curves"]


def _clean(value: Any) -> Any:
  if hasattr(value, "item"):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return value


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """All complete records of a metrics file (a torn last line from a kill is skipped)."""
  if not epath.Path(path).exists():
    return []
  rows = []
  with epath.Path(path).open() as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return rows


def truncate_after(path: str, step: int) -> None:
  """Keep only records with ``step <= step`` (atomic rewrite)."""
  rows = [r for r in read_jsonl(path) if r.get("step", -1) <= step]
  text = "".join(json.dumps(r) + "\n" for r in rows)
  if storage.is_remote(path):  # one object, replaced whole by the upload
    epath.Path(path).write_text(text)
    return
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


class MetricsWriter:
  """Append-only JSONL + optional TensorBoard scalars (local or ``gs://`` workdir)."""

  def __init__(self, workdir: str, tensorboard: bool = True, sinks: Sequence[Any] = (),
               upload_every_s: float = 30.0):
    """``sinks``: more outputs, each with ``write(step, record)`` and ``close()`` (e.g.
    ``rl_jax.wandb_log.WandbSink``)."""
    self.path = storage.join(workdir, "metrics.jsonl")
    self._remote = storage.is_remote(workdir)
    self._sinks = list(sinks)
    self._upload_every_s, self._uploaded = upload_every_s, time.monotonic()
    if self._remote:  # the file's lines, uploaded whole
      self._lines = [json.dumps(r) + "\n" for r in read_jsonl(self.path)]
      self._file = None
    else:
      self._file = open(self.path, "a")
    self._tb = self._tb_remote = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      tb_dir = storage.join(workdir, "tensorboard")
      if self._remote:
        self._tb_remote, tb_dir = tb_dir, tempfile.mkdtemp(prefix="rl_jax_tensorboard_")
      self._tb = SummaryWriter(tb_dir)

  def write(self, step: int, values: Mapping[str, Any]) -> None:
    record = {"step": int(step), **{k: _clean(v) for k, v in values.items()}}
    if self._remote:
      self._lines.append(json.dumps(record) + "\n")
      if time.monotonic() - self._uploaded > self._upload_every_s:
        self.flush()
    else:
      self._file.write(json.dumps(record) + "\n")
      self._file.flush()
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)):
          self._tb.add_scalar(k, v, step)
    for sink in self._sinks:
      sink.write(int(step), record)

  def flush(self) -> None:
    """Makes every written row durable (uploads the file and the events on ``gs://``)."""
    if not self._remote:
      return
    epath.Path(self.path).write_text("".join(self._lines))
    if self._tb is not None:
      self._tb.flush()
      storage.upload_dir(self._tb.logdir, self._tb_remote)
    self._uploaded = time.monotonic()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    for sink in self._sinks:
      sink.close()
    if self._tb is not None:
      self._tb.close()
    self.flush()
    if self._tb_remote is not None:
      shutil.rmtree(self._tb.logdir, ignore_errors=True)


def plot_curves(metrics_path: str, out_png: str,
                keys: tuple[str, ...] = ("reward_mean", "eval_accuracy")) -> str | None:
  """Plot the given metrics against step into a PNG; returns the path (None if no data)."""
  rows = read_jsonl(metrics_path)
  series = {k: [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
            for k in keys}
  if not any(series.values()):
    return None
  # A Figure on its own Agg canvas, not pyplot: the caller's backend (a notebook's inline
  # plots) is left alone.
  from matplotlib.backends import backend_agg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
  fig = Figure(figsize=(6, 3.5))
  backend_agg.FigureCanvasAgg(fig)
  ax = fig.subplots()
  for k, pts in series.items():
    if pts:
      xs, ys = zip(*pts)
      ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, label=k)
  ax.set_xlabel("step")
  ax.set_ylim(-0.02, 1.02)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=100)
  epath.Path(out_png).write_bytes(buf.getvalue())
  return out_png
