"""Start-up of the quickstart: time to the first RL step and time spent compiling.

Three kinds of run of ``python -m rl_jax.train --config=configs/quickstart.py`` (with
``train.steps=1``: the supervised warm start, its evaluation, one RL step and the final
evaluation; every program of a full quickstart run is compiled by then), each in a fresh
process and a fresh workdir, interleaved over ``--repeats`` rounds:

* ``baseline`` (with ``--baseline-root``): another checkout of rl_jax (e.g. the code before
  the start-up work, ``git archive <rev> | tar -x -C DIR``), no compilation cache;
* ``first``: this checkout with an empty persistent compilation cache;
* ``second``: this checkout again, a new workdir sharing the ``first`` run's cache (a rerun).

Measured per run: seconds from process launch to the first RL step's metrics row (polled),
and the compile time until then and in total (``jax.monitoring`` durations of tracing,
lowering and backend compiles, or cache loads, recorded by a listener in the child process).

Usage::

    python scripts/bench_startup.py --repeats 3 --baseline-root /tmp/rl_jax_before
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The child: records compile-event durations (cumulative, with wall time) to a file, then
# runs the trainer's command line.
_CHILD = r"""
import json, sys, time
import jax
EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
          "/jax/core/compile/jaxpr_to_mlir_module_duration",
          "/jax/core/compile/backend_compile_duration")
log, total = open(sys.argv[1], "w"), [0.0]
def record(event, duration, **_):
  if event in EVENTS:
    total[0] += duration
    log.write(json.dumps([time.time(), total[0]]) + "\n"); log.flush()
jax.monitoring.register_event_duration_secs_listener(record)
from rl_jax.train import loop
loop.main(["rl_jax.train"] + sys.argv[2:])
"""


def run_once(root: str, workdir: str, extra: list[str], poll_s: float = 0.01) -> dict:
  """One quickstart run in a new process; returns its start-up figures (seconds)."""
  os.makedirs(workdir)
  log = os.path.join(workdir, "compile_log.jsonl")
  metrics = os.path.join(workdir, "metrics.jsonl")
  cmd = [sys.executable, "-c", _CHILD, log, f"--config={root}/configs/quickstart.py",
         f"--workdir={workdir}", "--config.train.steps=1", "--config.log.tensorboard=False",
         *extra]
  env = dict(os.environ, PYTHONPATH=root)
  t0 = time.time()
  proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  first_rl = None
  while proc.poll() is None:
    if first_rl is None and os.path.exists(metrics):
      with open(metrics) as f:
        if any('"phase": "rl"' in line for line in f):
          first_rl = time.time()
    time.sleep(poll_s)
  err = proc.stderr.read()
  if proc.returncode != 0:
    raise RuntimeError(f"run failed ({proc.returncode}): {err[-2000:]}")
  if first_rl is None:  # finished between two polls
    first_rl = os.path.getmtime(metrics)
  events = [json.loads(line) for line in open(log)] or [[t0, 0.0]]
  before = [c for t, c in events if t <= first_rl]
  return {"to_first_rl_step_s": first_rl - t0, "compile_to_first_rl_s": before[-1] if before
          else 0.0, "compile_total_s": events[-1][1], "wall_s": time.time() - t0}


def _median(xs):
  xs = sorted(xs)
  n = len(xs)
  return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--baseline-root", default=None, help="another rl_jax checkout to compare")
  ap.add_argument("--out", default=None, help="also write the table (markdown) here")
  args = ap.parse_args(argv)
  kinds = (["baseline"] if args.baseline_root else []) + ["first", "second"]
  results = {k: [] for k in kinds}
  base = tempfile.mkdtemp(prefix="bench_startup_")
  try:
    for r in range(args.repeats):
      cache = os.path.join(base, f"cache{r}")  # shared by this round's first and second
      for kind in kinds:
        root = args.baseline_root if kind == "baseline" else ROOT
        extra = [] if kind == "baseline" else [f"--config.train.compile_cache={cache}"]
        res = run_once(root, os.path.join(base, f"{kind}{r}"), extra)
        results[kind].append(res)
        print(kind, r, {k: round(v, 2) for k, v in res.items()}, flush=True)
  finally:
    shutil.rmtree(base, ignore_errors=True)
  keys = ("to_first_rl_step_s", "compile_to_first_rl_s", "compile_total_s")
  med = {k: {m: _median([x[m] for x in results[k]]) for m in keys} for k in kinds}
  lines = [f"machine: {platform.machine()} {os.cpu_count()} CPUs, JAX "
           f"{__import__('jax').__version__}; medians of {args.repeats} interleaved rounds",
           "", "| run | to first RL step (s) | compile before it (s) | compile, whole run (s) |",
           "|---|---|---|---|"]
  for k in kinds:
    lines.append(f"| {k} | " + " | ".join(f"{med[k][m]:.1f}" for m in keys) + " |")
  first = med["first"]
  lines.append("")
  lines.append(f"second run reaches its first RL step "
               f"{first['to_first_rl_step_s'] / med['second']['to_first_rl_step_s']:.2f}x sooner")
  if "baseline" in med:
    cut = 1 - first["compile_total_s"] / med["baseline"]["compile_total_s"]
    lines.append(f"first-run compile time vs baseline: {100 * cut:.0f}% less")
  text = "\n".join(lines)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  return {"medians": med, "runs": results}


if __name__ == "__main__":
  main()
