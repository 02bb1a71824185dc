"""Asynchronous vs synchronous training, measured on the quickstart's sorting task.

Two measurements, each run as real training jobs (``python -m rl_jax.train``, one subprocess
per run, so every run starts cold in the same way):

``throughput``: RL steps per second of ``train.mode=sync`` and of ``train.mode=async``
(fixed lag 1) on the same devices (2 fake CPU devices: sync uses both as its mesh; async gives
one to the rollout producer and one to the learner), on a workload whose rollouts have
long-tailed lengths (``rollout.max_new_tokens`` well above the 4-token answers, temperature
1: early policies ramble until the cap, later ones stop early), so that sampling and the
update cost about the same. Runs alternate sync / async (``--repeats`` pairs); steps per
second are counted over the RL steps after the first two (compilation). Also reported:
the final held-out accuracy of each, and the producer / learner utilisation of the async runs.

``staleness``: held-out accuracy curves at fixed lag k in ``--lags`` for plain GRPO,
decoupled PPO, M2PO and VCPO, ``--seeds`` seeds each, same seeds across methods; one table
(final accuracy, mean ± std over seeds) and one PNG.

Usage::

    python scripts/bench_async.py throughput --repeats 3
    python scripts/bench_async.py throughput --repeats 3 \
        --extra rollout.max_new_tokens=64,model.max_position_embeddings=128
    python scripts/bench_async.py staleness --lags 0,1,4,8 --seeds 0,1,2 --png docs/async_staleness.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")
PRESETS = ("grpo", "decoupled_ppo", "m2po", "vcpo")


def run(workdir: str, overrides: list[str], devices: int = 1, cache: str | None = None) -> list[dict]:
  """One training run in a subprocess; its metrics rows."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  cmd = [sys.executable, "-m", "rl_jax.train", f"--config={QUICKSTART}", f"--workdir={workdir}"]
  cmd += [f"--config.{o}" for o in overrides]
  if cache:  # compiled programs shared across runs of the same shapes
    cmd.append(f"--config.train.compile_cache={cache}")
  subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL,
                 stderr=subprocess.PIPE)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _final_accuracy(rows: list[dict]) -> float:
  return [r["eval_accuracy"] for r in rows if "eval_accuracy" in r][-1]


# ------------------------------------------------------------------------- throughput
THROUGHPUT = ["rollout.max_new_tokens=48", "rollout.temperature=0.6", "train.batch_groups=8",
              "train.eval_every=10000", "log.tensorboard=False", "train.checkpoint_every=0",
              "mesh.num_devices=0", "eval.pass_k=0"]


def throughput(args) -> dict:
  split = ["mesh.rollout_devices=1"] if args.devices == 2 else []
  modes = {
      "sync": ["train.mode=sync"],
      "async": ["train.mode=async", "train.async_lag=1"] + split,
  }
  base = THROUGHPUT + [f"train.steps={args.steps}"] + [o for o in args.extra.split(",") if o]
  out = {m: {"steps_per_s": [], "accuracy": [], "producer_util": [], "learner_util": []}
         for m in modes}
  for rep in range(args.repeats):
    for mode, extra in modes.items():
      with tempfile.TemporaryDirectory() as d:
        rows = run(d, base + extra + [f"train.seed={rep}"], devices=args.devices)
      rl = [r for r in rows if r["phase"] == "rl"][2:]
      out[mode]["steps_per_s"].append(len(rl) / sum(r["step_time_s"] for r in rl))
      out[mode]["accuracy"].append(_final_accuracy(rows))
      out[mode]["producer_util"].append(np.mean([r.get("producer_utilisation", np.nan)
                                                 for r in rl]))
      out[mode]["learner_util"].append(np.mean([r.get("learner_utilisation", np.nan)
                                                for r in rl]))
      print(mode, rep, {k: round(v[-1], 3) for k, v in out[mode].items()}, flush=True)
  for mode in modes:
    print(f"{mode:6s} steps/s {np.mean(out[mode]['steps_per_s']):.2f} "
          f"(runs {np.round(out[mode]['steps_per_s'], 2).tolist()}), final held-out accuracy "
          f"{np.mean(out[mode]['accuracy']):.3f} (runs {out[mode]['accuracy']})")
  speedup = [a / s for a, s in zip(out["async"]["steps_per_s"], out["sync"]["steps_per_s"])]
  print(f"async / sync steps per second: {np.mean(speedup):.2f}x (pairs "
        f"{np.round(speedup, 2).tolist()}); async producer utilisation "
        f"{np.mean(out['async']['producer_util']):.2f}, learner utilisation "
        f"{np.mean(out['async']['learner_util']):.2f}")
  return out


# ------------------------------------------------------------------------- staleness
def staleness(args) -> dict:
  lags = [int(x) for x in args.lags.split(",")]
  seeds = [int(x) for x in args.seeds.split(",")]
  base = [f"train.steps={args.steps}", f"train.eval_every={args.eval_every}",
          "train.checkpoint_every=0", "log.tensorboard=False", "eval.pass_k=0",
          "train.mode=async", "train.allow_uncorrected=True",
          f"train.batch_groups={args.batch_groups}"]
  curves = {}
  with tempfile.TemporaryDirectory(prefix="rl_jax_bench_cache_") as cache:
    for seed in seeds:
      for preset in PRESETS:
        for lag in lags:
          t0 = time.time()
          with tempfile.TemporaryDirectory() as d:
            rows = run(d, base + [f"loss.preset={preset}", f"train.async_lag={lag}",
                                  f"train.seed={seed}", "loss.kl_beta=0.0"], cache=cache)
          curve = [(r["step"], r["eval_accuracy"]) for r in rows
                   if "eval_accuracy" in r and r["phase"] == "rl"]
          curves[(preset, lag, seed)] = curve
          print(f"{preset:14s} k={lag} seed={seed}: final {curve[-1][1]:.3f} "
                f"({time.time() - t0:.0f} s)", flush=True)
  print(f"\nfinal held-out accuracy after {args.steps} RL steps, mean ± std over seeds "
        f"{seeds}\n")
  print("| objective | " + " | ".join(f"k = {k}" for k in lags) + " |")
  print("|---|" + "---|" * len(lags))
  for preset in PRESETS:
    cells = []
    for lag in lags:
      final = [curves[(preset, lag, s)][-1][1] for s in seeds]
      cells.append(f"{np.mean(final):.3f} ± {np.std(final):.3f}")
    print(f"| {preset} | " + " | ".join(cells) + " |")
  if args.png:
    _plot(curves, lags, seeds, args.png)
  return {"|".join(map(str, k)): v for k, v in curves.items()}


def _plot(curves, lags, seeds, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, len(PRESETS), figsize=(4 * len(PRESETS), 3.2), sharey=True)
  for ax, preset in zip(axes, PRESETS):
    for lag in lags:
      steps = [s for s, _ in curves[(preset, lag, seeds[0])]]
      acc = np.mean([[a for _, a in curves[(preset, lag, s)]] for s in seeds], axis=0)
      ax.plot(steps, acc, marker="o", ms=3, label=f"k = {lag}")
    ax.set_title(preset)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  axes[0].set_ylabel(f"held-out accuracy (mean of {len(seeds)} seeds)")
  axes[-1].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"wrote {path}")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = p.add_subparsers(dest="what", required=True)
  t = sub.add_parser("throughput")
  t.add_argument("--repeats", type=int, default=3)
  t.add_argument("--steps", type=int, default=150)
  t.add_argument("--devices", type=int, default=2, choices=(1, 2),
                 help="2: sync on both, async one each; 1: both modes on one device")
  t.add_argument("--extra", default="",
                 help="comma-separated config overrides for both modes, after the workload's "
                      "(e.g. rollout.max_new_tokens=64 with model.max_position_embeddings=128)")
  s = sub.add_parser("staleness")
  s.add_argument("--lags", default="0,1,4,8")
  s.add_argument("--seeds", default="0,1,2")
  s.add_argument("--steps", type=int, default=100)
  s.add_argument("--batch-groups", type=int, default=16)
  s.add_argument("--eval-every", type=int, default=25)
  s.add_argument("--png", default=None)
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  result = throughput(args) if args.what == "throughput" else staleness(args)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1, default=float)


if __name__ == "__main__":
  main()
