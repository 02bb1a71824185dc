"""Where a step's time goes: a per-program, per-op table from a ``jax.profiler`` trace.

``--config.train.profile_step=N`` traces step N into ``WORKDIR/profile`` (with a Perfetto
trace, ``*.trace.json.gz``) and writes this module's summary next to it
(``profile/summary.txt``); ``python -m rl_jax.profiling WORKDIR/profile`` prints it for any
trace directory. No TensorBoard needed.

Every XLA op the runtime records carries ``hlo_module`` (the program, e.g. ``jit_update``)
and ``hlo_op`` (the op or fusion in that program's HLO). Ops nest (a ``while`` op contains its
body's ops), so times are *exclusive*: an op's duration minus that of the ops recorded inside
it on the same thread. The kind column sorts ops by their HLO name: ``matmul`` (dots, oneDNN /
YNNPACK / cuBLAS fusions, convolutions), ``copy/transpose`` (layout changes and copies),
``loop`` (a loop's own bookkeeping), ``other`` (elementwise and reduction fusions). Use
``jit(f).lower(...).compile().as_text()`` to read an op's source location from its name.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import sys
from typing import Iterable, NamedTuple

__all__ = ["OpTime", "exclusive_times", "kind", "load_events", "op_times", "summarize", "main"]


class OpTime(NamedTuple):
  """Exclusive time of one op of one program over the whole trace."""
  module: str
  op: str
  calls: int
  micros: float


def load_events(directory: str) -> list[dict]:
  """The trace events of the newest ``*.trace.json.gz`` under ``directory``."""
  files = glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    raise FileNotFoundError(f"no *.trace.json.gz under {directory} (was the trace written "
                            "with create_perfetto_trace=True?)")
  with gzip.open(max(files, key=os.path.getmtime)) as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def exclusive_times(events: Iterable[dict]) -> list[tuple[dict, float]]:
  """(event, exclusive µs) for every complete ("X") event: its duration minus that of the
  events nested inside it on the same thread (an event nests when it starts and ends
  within its parent)."""
  by_thread = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and "dur" in e:
      by_thread[(e.get("pid"), e.get("tid"))].append(e)
  out = []
  for evs in by_thread.values():
    evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack: list[list] = []  # [event, end, exclusive]
    for e in evs:
      end = e["ts"] + e["dur"]
      while stack and e["ts"] >= stack[-1][1]:
        out.append(tuple(stack.pop()[::2]))
      if stack and end <= stack[-1][1]:
        stack[-1][2] -= e["dur"]
      stack.append([e, end, float(e["dur"])])
    out.extend(tuple(s[::2]) for s in stack)
  return out


def op_times(events: Iterable[dict]) -> list[OpTime]:
  """Exclusive time per (program, op), most expensive first; only events that name an HLO
  op (``args.hlo_op``) count."""
  acc: dict[tuple[str, str], list] = {}
  for e, excl in exclusive_times(events):
    args = e.get("args") or {}
    if "hlo_op" not in args:
      continue
    row = acc.setdefault((args.get("hlo_module", "?"), args["hlo_op"]), [0, 0.0])
    row[0] += 1
    row[1] += excl
  rows = [OpTime(m, o, c, t) for (m, o), (c, t) in acc.items()]
  return sorted(rows, key=lambda r: -r.micros)


def kind(op: str) -> str:
  """Coarse kind of an HLO op from its name (see the module docstring)."""
  name = op.lower()
  if any(k in name for k in ("dot", "ynn", "onednn", "gemm", "cublas", "convolution", "matmul")):
    return "matmul"
  if "copy" in name or "transpose" in name:
    return "copy/transpose"
  if name.startswith(("while", "cond", "conditional", "call")):
    return "loop"
  return "other"


def summarize(directory: str, top: int = 15) -> str:
  """A text report of the trace under ``directory``: time per program, per kind of op, and
  the ``top`` most expensive ops (exclusive milliseconds over the whole trace)."""
  rows = op_times(load_events(directory))
  total = sum(r.micros for r in rows) or 1.0
  lines = [f"XLA op time in the trace: {total / 1e3:.1f} ms (exclusive, all threads)", "",
           "| program | ms | share |", "|---|---|---|"]
  programs = _totals(rows, lambda r: r.module)
  small = [us for _, us in programs if us < 0.005 * total]
  for name, us in programs:
    if us >= 0.005 * total:
      lines.append(f"| {name} | {us / 1e3:.1f} | {us / total:.0%} |")
  if small:
    lines.append(f"| ({len(small)} programs under 0.5% each) | {sum(small) / 1e3:.1f} | "
                 f"{sum(small) / total:.0%} |")
  lines += ["", "| kind of op | ms | share |", "|---|---|---|"]
  for name, us in _totals(rows, lambda r: kind(r.op)):
    lines.append(f"| {name} | {us / 1e3:.1f} | {us / total:.0%} |")
  lines += ["", "| program | op | kind | calls | ms | share |", "|---|---|---|---|---|---|"]
  for r in rows[:top]:
    lines.append(f"| {r.module} | {r.op} | {kind(r.op)} | {r.calls} | {r.micros / 1e3:.1f} | "
                 f"{r.micros / total:.1%} |")
  return "\n".join(lines) + "\n"


def _totals(rows: list[OpTime], key) -> list[tuple[str, float]]:
  acc = collections.Counter()
  for r in rows:
    acc[key(r)] += r.micros
  return acc.most_common()


def main(argv=None) -> None:
  """``python -m rl_jax.profiling TRACE_DIR [TOP]``: print the summary."""
  argv = sys.argv[1:] if argv is None else argv
  if not argv:
    raise SystemExit("usage: python -m rl_jax.profiling TRACE_DIR [TOP]")
  print(summarize(argv[0], int(argv[1]) if len(argv) > 1 else 15), end="")


if __name__ == "__main__":
  main()
