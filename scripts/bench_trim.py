"""The learner on a step whose responses are short beside their budget: the update on the
batch cut to its longest response (``train.trim_floor``) against the whole budget, and the
cut batch with several responses per row (``train.pack_floor``).

The random Qwen3-style policy and GRPO trainer of ``bench_micro_batches.py`` (3.7M
parameters, float32, one device), ``--groups`` prompts x ``--samples`` samples, a response
budget of ``--budget`` tokens (``rollout.max_new_tokens``). One batch is sampled to the
budget or its EOS (id 255, about 1 token in 256), then each sample is ended after a length
drawn from a geometric distribution of mean ``--mean-length`` (seeded; at most its sampled
length), as an EOS there would end it: the tokens after it become masked padding.
``learner_batch`` turns that batch into the update's input three times: at
``train.trim_floor=--floor`` (cut to the smallest power of two, at least the floor, that
holds the longest sample) and at 0 (the whole budget), both with one response per row
(``train.pack_floor=0``), then cut with rows of several responses (``--pack-floor``, rl_jax's
default 128). The compiled updates then take turns for ``--repeats`` rounds, each on a fresh
copy of the same state; reported: the lengths and rows, each update's median and worst time,
compile time, temporary bytes, the speed-up over the whole budget, and the largest difference
of the updated parameters from the whole budget's (float rounding; ``tests/test_trim.py`` and
``tests/test_packing.py`` check the updates are the same).

Usage::

    python scripts/bench_trim.py --repeats 5
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

import bench_micro_batches  # noqa: E402  (the trainer, its weights and its task)
import bench_tunix  # noqa: E402
from rl_jax import train  # noqa: E402
from rl_jax.train.learner import learner_batch  # noqa: E402
from rl_jax.train.producer import produce  # noqa: E402


def ended_early(scored, mean_length: float, seed: int, pad: int):
  """``scored`` with sample i ended after min(L_i, its sampled length) tokens, L_i drawn from
  a geometric distribution of mean ``mean_length`` (what EOS there would return)."""
  rng = np.random.default_rng(seed)
  lengths = np.minimum(rng.geometric(1.0 / mean_length, size=scored.tokens.shape[0]),
                       scored.mask.sum(axis=1))
  keep = np.arange(scored.tokens.shape[1])[None, :] < lengths[:, None]
  return scored._replace(tokens=np.where(keep, scored.tokens, pad).astype(np.int32),
                         mask=scored.mask & keep,
                         logprobs=np.where(keep, scored.logprobs, 0.0).astype(np.float32)), lengths


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--groups", type=int, default=1)
  ap.add_argument("--samples", type=int, default=16)
  ap.add_argument("--budget", type=int, default=1024)
  ap.add_argument("--mean-length", type=float, default=64.0)
  ap.add_argument("--floor", type=int, default=128)
  ap.add_argument("--pack-floor", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  with tempfile.TemporaryDirectory(prefix="bench_trim_") as tmp:
    return _measure(args, os.path.join(tmp, "weights"))


def _measure(args, weights: str) -> dict:
  """``main``'s measurement, with the shared weights written to ``weights``."""
  bench_tunix.write_weights(weights, args.budget)
  s, t = bench_micro_batches.trainer(weights, args.groups, args.samples, args.budget, 1)
  state = train.begin_rl(s, train.init_state(s))
  scored, _ = produce(t, t.layout.sampler_params(state.params), state.producer, step=0,
                      version=0, lo=0, hi=s.geometry.rows)
  scored, lengths = ended_early(scored, args.mean_length, args.seed, s.tokenizer.pad_id)
  with_floor = lambda f, p=0: t._replace(setup=dataclasses.replace(
      s, train=dataclasses.replace(s.train, trim_floor=f, pack_floor=p)))
  batches = {"cut": learner_batch(with_floor(args.floor), state, scored)[0],
             "whole budget": learner_batch(with_floor(0), state, scored)[0],
             "cut, rows packed": learner_batch(with_floor(args.floor, args.pack_floor), state,
                                               scored)[0]}
  carry = (state.params, state.opt_state, state.value_params, state.value_opt_state)
  fresh = lambda: jax.tree.map(jnp.copy, carry)
  rows, compiled, params = {}, {}, {}
  for name, b in batches.items():
    t0 = time.perf_counter()
    compiled[name] = t.steps.rl_update.lower(*carry, b).compile()
    rows[name] = dict(length=int(b.tokens.shape[2]), compile_s=time.perf_counter() - t0,
                      rows=int(b.tokens.shape[1] if b.packing is None else b.packing[0].shape[1]),
                      temp_mb=compiled[name].memory_analysis().temp_size_in_bytes / 1e6,
                      times=[])
    out = compiled[name](*fresh(), b)
    params[name] = jax.device_get(out[0])
  for _ in range(args.repeats):
    for name, b in batches.items():
      c = fresh()
      jax.block_until_ready(c)
      t0 = time.perf_counter()
      jax.block_until_ready(compiled[name](*c, b))
      rows[name]["times"].append(time.perf_counter() - t0)
  diff = {name: max(float(np.max(np.abs(a - b))) for a, b in zip(
      jax.tree.leaves(params[name]), jax.tree.leaves(params["whole budget"])))
          for name in batches if name != "whole budget"}
  print(f"{args.groups} group(s) x {args.samples} samples, budget {args.budget}, lengths "
        f"geometric with mean {args.mean_length:g} (drawn: mean {lengths.mean():.0f}, longest "
        f"{lengths.max()}), train.trim_floor={args.floor}, train.pack_floor={args.pack_floor}; "
        f"JAX {jax.__version__} "
        f"{jax.default_backend()}; {os.cpu_count()} CPUs; load average "
        f"{os.getloadavg()[0]:.1f}")
  print("| batch | response length R | rows per group | update temporaries (MB) | compile (s) "
        "| update, median (ms) | worst (ms) | speed-up |")
  print("|---|---|---|---|---|---|---|---|")
  base = np.median(rows["whole budget"]["times"])
  for name, r in rows.items():
    med = float(np.median(r["times"]))
    print(f"| {name} | {r['length']} | {r['rows']} | {r['temp_mb']:.1f} | {r['compile_s']:.2f} | "
          f"{1e3 * med:.0f} | {1e3 * max(r['times']):.0f} | {base / med:.2f}x |", flush=True)
    r.update(median_s=med)
  print("largest difference of the updated parameters from the whole budget's: "
        + ", ".join(f"{name} {d:.1e}" for name, d in diff.items()))
  return dict(rows=rows, max_abs_diff=diff, longest=int(lengths.max()))


if __name__ == "__main__":
  main()
