"""Gradient accumulation (``train.micro_batches``): the update's memory and time per k.

The random Qwen3-style policy of ``bench_tunix.py`` (hidden 256, 4 layers, 4 query / 2 KV
heads of 64, MLP 896, 256-symbol vocabulary: 3.7M parameters, float32), the trainer's GRPO
update (``train.steps.make_rl_update``, one minibatch, ``train.old_logp_pass=auto``) on one
collected batch of ``--groups`` prompts x ``--samples`` samples x up to ``--new-tokens`` tokens.
For each k in ``--ks`` (dividing the groups): the compiled update's temporary bytes (XLA's
memory analysis: activations, their gradients and the accumulation), its compile time, then the median and worst of ``--repeats`` interleaved calls, each on a fresh copy
of the same state and batch, and the largest difference of the updated parameters from k=1's
(float rounding; ``tests/test_micro_batches.py`` checks the update is the same).

Usage::

    python scripts/bench_micro_batches.py --repeats 5
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_tunix  # noqa: E402  (the weights and the trainer's config of its GRPO side)
from rl_jax import config_utils, train  # noqa: E402
from rl_jax.data.base import Example  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trainer(weights: str, groups: int, samples: int, new_tokens: int, k: int):
  """The GRPO trainer of ``bench_tunix.py``'s rl_jax side with G groups and k micro-batches:
  the same prompt every group, a reward with variance inside a group."""
  config = config_utils.load_config(os.path.join(ROOT, "configs", "quickstart.py"), [
      f"model.hf_path={weights}", "data.tokenizer=char", "sft.steps=0",
      f"train.batch_groups={groups}", f"rollout.n={samples}",
      f"rollout.max_new_tokens={new_tokens}", f"rollout.eos_id={bench_tunix.EOS}",
      "rollout.temperature=1.0", "train.eval_every=0", "train.compile_cache=",
      "train.old_logp_pass=auto", "log.tensorboard=False", "loss.preset=grpo",
      "loss.kl_beta=0.0", f"data.max_prompt_len={bench_tunix.MAX_PROMPT}", "optim.lr=1e-5",
      f"train.micro_batches={k}", "mesh.num_devices=1"])
  s = train.build_setup(config)
  task = type("Task", (), {"split": lambda self, w, n=None: s.task.split(w, n),
                           "verify": lambda self, c, a: bench_tunix._reward(c)})()
  examples = [Example(bench_tunix.PROMPT, "")] * len(s.train_examples)
  s = dataclasses.replace(s, task=task, tokenizer=bench_tunix._RljaxBytes(),
                          train_examples=examples,
                          prompt_len=max(s.prompt_len, len(bench_tunix.PROMPT.encode()) + 1))
  return s, train.make_trainer(s)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--groups", type=int, default=8)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--ks", default="1,2,4,8")
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args(argv)
  ks = [int(k) for k in args.ks.split(",")]
  with tempfile.TemporaryDirectory(prefix="bench_micro_batches_") as tmp:
    return _measure(args, ks, os.path.join(tmp, "weights"))


def _measure(args, ks: list[int], weights: str) -> dict:
  """``main``'s measurement, with the shared weights written to ``weights``."""
  bench_tunix.write_weights(weights, args.new_tokens)
  s, whole = trainer(weights, args.groups, args.samples, args.new_tokens, 1)
  state = train.begin_rl(s, train.init_state(s))
  batch, _, _ = train.collect(whole, state)
  carry = (state.params, state.opt_state, state.value_params, state.value_opt_state)
  updates = {k: whole.steps.rl_update if k == 1 else
             trainer(weights, args.groups, args.samples, args.new_tokens, k)[1].steps.rl_update
             for k in ks}
  fresh = lambda: jax.tree.map(jnp.copy, carry)
  rows, params = {}, {}
  for k, fn in updates.items():
    t0 = time.perf_counter()
    compiled = fn.lower(*carry, batch).compile()
    compile_s = time.perf_counter() - t0
    out = compiled(*fresh(), batch)
    jax.block_until_ready(out)
    updates[k] = compiled  # the timed calls run this program
    rows[k] = dict(temp_mb=compiled.memory_analysis().temp_size_in_bytes / 1e6,
                   compile_s=compile_s, times=[])
    params[k] = jax.device_get(out[0])
  for _ in range(args.repeats):
    for k, fn in updates.items():
      c = fresh()
      jax.block_until_ready(c)
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*c, batch))
      rows[k]["times"].append(time.perf_counter() - t0)
  tokens = int(np.asarray(batch.inputs.mask).sum())
  print(f"{args.groups} groups x {args.samples} samples, {tokens} response tokens; JAX "
        f"{jax.__version__} {jax.default_backend()}; {os.cpu_count()} CPUs; load average "
        f"{os.getloadavg()[0]:.1f}")
  print("| train.micro_batches | update temporaries (MB) | compile (s) | update, median (ms) "
        "| worst (ms) | vs k=1 | max abs diff of params vs k=1 |")
  print("|---|---|---|---|---|---|---|")
  base = np.median(rows[ks[0]]["times"])
  for k, r in rows.items():
    diff = max(float(np.max(np.abs(a - b))) for a, b in
               zip(jax.tree.leaves(params[k]), jax.tree.leaves(params[ks[0]])))
    med = np.median(r["times"])
    print(f"| {k} | {r['temp_mb']:.1f} | {r['compile_s']:.2f} | {1e3 * med:.0f} | "
          f"{1e3 * max(r['times']):.0f} | {base / med:.2f}x | {diff:.1e} |", flush=True)
    r.update(median_s=float(med), max_abs_diff=diff)
  return rows


if __name__ == "__main__":
  main()
