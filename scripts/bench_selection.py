"""Prompt selection and speculative rollouts, measured in the trainer.

Selection: the ``sort_mix`` task (easy copy, learnable sort and impossible hash prompts),
the quickstart model, a short supervised warm start, then RL with each ``data.selector``.
Reported per run: rollout tokens (every sampled token, including groups a selector drops)
and rollout wall time (sampling only, without the first RL step, which compiles) until the held-out greedy accuracy first reaches ``--target``, and the
final accuracy. Runs are interleaved: for each seed, every method in turn.

SPEC-RL: the same task revisited for several epochs with ``rollout.speculative`` off and
on (interleaved per seed); reported: rollout seconds per epoch from the second epoch on
(the first has no drafts; total, and the median step times the steps of an epoch, which
leaves out one-off compilations), the reused-token fraction and the final accuracy.

    python scripts/bench_selection.py selection [--seeds 0,1,2 --steps 120 --target 0.5]
        [--methods none,dapo,greso,beta,adaptive]  (adaptive: data.group_size=adaptive)
    python scripts/bench_selection.py spec [--seeds 0,1,2 --epochs 4 --difficulty 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from rl_jax import config_utils, metrics, train  # noqa: E402
from rl_jax.data import tasks  # noqa: E402

QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")
BASE = ["data.task=sort_mix", "data.difficulty=0", "data.eval_size=256",
        "rollout.max_new_tokens=4", "train.checkpoint_every=0", "log.tensorboard=False",
        "eval.pass_k=0"]


def run(overrides: list[str]) -> list[dict]:
  """One training run (later overrides win); its metrics rows."""
  config = config_utils.load_config(QUICKSTART, BASE + overrides)
  with tempfile.TemporaryDirectory() as d:
    train.train(config, d, progress=False)
    return metrics.read_jsonl(os.path.join(d, "metrics.jsonl"))


def rollout_cost(row: dict, groups: int, n: int) -> tuple[float, float]:
  """(rollout tokens, rollout seconds) of one RL step's metrics row: every sampled token
  (``rollout_tokens`` when a selector reports it, else the trained ones), and the sampling
  time (``rollout_tokens_per_s`` divides the trained tokens by it)."""
  trained = row["response_length"] * groups * n
  return row.get("rollout_tokens", trained), trained / max(row["rollout_tokens_per_s"], 1e-9)


def to_target(rows: list[dict], target: float, groups: int, n: int) -> dict:
  """Cumulative RL rollout tokens / seconds at the first eval step with accuracy >= target."""
  tok = sec = 0.0
  out = {"tokens": None, "seconds": None, "step": None}
  curve = []  # (step, cumulative tokens, cumulative seconds, accuracy) at each RL eval
  first = True
  for r in rows:
    if r.get("phase") == "rl":
      t, s = rollout_cost(r, groups, n)
      tok, sec = tok + t, sec + (0.0 if first else s)  # the first RL step compiles
      first = False
    if "eval_accuracy" in r and r.get("phase") == "rl":
      curve.append((r["step"], tok, round(sec, 3), r["eval_accuracy"]))
      if out["step"] is None and r["eval_accuracy"] >= target:
        out = {"tokens": tok, "seconds": sec, "step": r["step"]}
  final = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
  return {**out, "final_accuracy": final[-1], "total_tokens": _total(rows, groups, n),
          "curve": curve}


def _total(rows, groups, n):
  return sum(rollout_cost(r, groups, n)[0] for r in rows if r.get("phase") == "rl")


# methods that are not a data.selector value: their overrides
METHODS = {"adaptive": ["data.group_size=adaptive", "data.group_chunk=2", "data.beta_decay=0.99"]}


def method_overrides(m: str) -> list[str]:
  """The config overrides of a method: a ``data.selector`` value or a name in ``METHODS``."""
  return METHODS.get(m, [f"data.selector={m}"])


def selection(args) -> dict:
  methods = args.methods.split(",")
  G, n = args.groups, 8
  common = [f"train.steps={args.steps}", f"train.batch_groups={G}", "train.eval_every=10",
            "sft.steps=25"]
  results = {m: [] for m in methods}
  for seed in [int(s) for s in args.seeds.split(",")]:
    for m in methods:
      rows = run(common + [f"train.seed={seed}", f"data.seed={seed}"] + method_overrides(m))
      res = to_target(rows, args.target, G, n)
      results[m].append(res)
      print(json.dumps({"seed": seed, "method": m, **res}), flush=True)
  return results


def spec(args) -> dict:
  G, n = args.groups, 8
  train_prompts = len(tasks.get_task("sort_mix", difficulty=args.difficulty).split("train"))
  per_epoch = -(-train_prompts // G)
  steps = args.epochs * per_epoch
  common = [f"train.steps={steps}", f"train.batch_groups={G}", f"train.eval_every={steps}",
            "sft.steps=25", f"data.difficulty={args.difficulty}",
            f"rollout.max_new_tokens={args.max_new_tokens}", "data.max_prompt_len=24"]
  results = {"plain": [], "speculative": []}
  for seed in [int(s) for s in args.seeds.split(",")]:
    for name, flag in (("plain", "False"), ("speculative", "True")):
      rows = [r for r in run(common + [f"train.seed={seed}", f"data.seed={seed}",
                                       f"rollout.speculative={flag}"]) if r["phase"] == "rl"]
      later = rows[per_epoch:]
      per_step = [rollout_cost(r, G, n)[1] for r in later]
      res = {"rollout_s_per_epoch": sum(per_step) / max(args.epochs - 1, 1),
             # the median step times the epoch: one-off compilations (new resume shapes)
             # left out
             "median_rollout_s_per_epoch": statistics.median(per_step) * per_epoch,
             "final_accuracy": rows[-1].get("eval_accuracy"),
             "reused_token_fraction": statistics.mean(
                 r.get("spec_reused_token_fraction", 0.0) for r in later)}
      results[name].append(res)
      print(json.dumps({"seed": seed, "mode": name, **res}), flush=True)
  return results


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("part", choices=("selection", "spec"))
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--methods", default="none,dapo,greso,beta,adaptive")
  p.add_argument("--steps", type=int, default=120)
  p.add_argument("--groups", type=int, default=16)
  p.add_argument("--target", type=float, default=0.5)
  p.add_argument("--epochs", type=int, default=4)
  p.add_argument("--difficulty", type=int, default=2)  # spec: sort_mix level (long answers)
  p.add_argument("--max-new-tokens", type=int, default=10)  # spec
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  res = selection(args) if args.part == "selection" else spec(args)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(res, f, indent=1)
  return res


if __name__ == "__main__":
  main()
