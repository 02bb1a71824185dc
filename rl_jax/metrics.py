"""Metrics sinks: JSONL (the record of truth), TensorBoard, optional extra sinks (Weights &
Biases, ``rl_jax.wandb_log``), and a PNG of the curves.

``metrics.jsonl`` holds one JSON object per line with ``"step"``; on resume, lines past the
restored step are dropped (rewritten atomically) so a rerun never duplicates a step.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Sequence

__all__ = ["MetricsWriter", "read_jsonl", "truncate_after", "plot_curves"]


def _clean(value: Any) -> Any:
  if hasattr(value, "item"):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return value


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """All complete records of a metrics file (a torn last line from a kill is skipped)."""
  if not os.path.exists(path):
    return []
  rows = []
  with open(path) as f:
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
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  os.replace(tmp, path)


class MetricsWriter:
  """Append-only JSONL + optional TensorBoard scalars."""

  def __init__(self, workdir: str, tensorboard: bool = True, sinks: Sequence[Any] = ()):
    """``sinks``: more outputs, each with ``write(step, record)`` and ``close()`` (e.g.
    ``rl_jax.wandb_log.WandbSink``)."""
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._sinks = list(sinks)
    self._file = open(self.path, "a")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, values: Mapping[str, Any]) -> None:
    record = {"step": int(step), **{k: _clean(v) for k, v in values.items()}}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)):
          self._tb.add_scalar(k, v, step)
    for sink in self._sinks:
      sink.write(int(step), record)

  def close(self) -> None:
    self._file.close()
    for sink in self._sinks:
      sink.close()
    if self._tb is not None:
      self._tb.close()


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
  fig.savefig(out_png, dpi=100)
  return out_png
