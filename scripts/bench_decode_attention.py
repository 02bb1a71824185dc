"""The decode query's attention with keys cached length-last vs keys cached [.., len, H].

``rollout.decode.decode_attention`` reads the prompt-once caches of ``rollout.kv_cache``:
keys length-last (prefix [G,K,H,P], suffix [G,M,K,H,R]), values [.., len, H]. The baseline
here is the same function reading keys stored [.., len, H] like the values
(``keys_length_last=False``), so the score products contract the minor dim of both operands
(q·Kᵀ per (group, sample, kv head)).

Each variant runs ``--layers`` attention calls per step in a ``fori_loop`` of ``--steps``
decode steps (the query updated from the output so nothing is hoisted), the valid suffix
growing by one position per step. Shapes: 4 query / 2 kv heads of 64 (the sampling
benchmark's model), for distinct prompts (G = 16 slots of M = 1 sample) and one shared
prompt (G = 1, M = 16), at 64 and 256 cache positions. The max abs difference of the two
outputs is printed with each row (float32 rounding: 0 to 1e-6); timings are the median of
``--repeats`` interleaved calls.

Usage::

    python scripts/bench_decode_attention.py --repeats 7
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rl_jax.rollout.decode import decode_attention  # noqa: E402

SHAPES = [(16, 1, 32, 64), (1, 16, 10, 64), (16, 1, 32, 256), (1, 16, 10, 256)]  # G,M,P,R


def attention_keys_by_position(*args):
  """The baseline: ``decode_attention`` reading keys [G,K,P,H] / [G,M,K,R,H] (laid out like
  the values, as the caches stored them before)."""
  return decode_attention(*args, keys_length_last=False)


def program(fn, layers: int, steps: int, R: int):
  """A jitted decode-like loop: ``layers`` attention calls per step, ``steps`` steps."""
  @jax.jit
  def run(q, pk, pv, pvalid, sk, sv):
    G, M = q.shape[:2]

    def body(i, q):
      svalid = jnp.broadcast_to(jnp.arange(R) <= i, (G, M, R))
      for l in range(layers):
        q = q + 0.01 * fn(q, pk[l], pv[l], pvalid, sk[l], sv[l], svalid)
      return q
    return jax.lax.fori_loop(0, steps, body, q)
  return run


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--steps", type=int, default=64)
  ap.add_argument("--quick", action="store_true", help="the first shape only (a smoke run)")
  args = ap.parse_args(argv)
  N, K, H, L = 4, 2, 64, args.layers
  print(f"jax {jax.__version__}, {os.cpu_count()} cores; {L} layers x {args.steps} steps; "
        f"N={N} K={K} H={H}; µs per layer per step, median of {args.repeats}", flush=True)
  print("| G x M, prompt P, cache R | keys [.., len, H] | keys length-last | speed-up | "
        "max abs diff |")
  print("|---|---|---|---|---|")
  rng = np.random.default_rng(0)
  rows = []
  for G, M, P, R in SHAPES[:1] if args.quick else SHAPES:
    normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q = normal(G, M, N, H)
    pk = [normal(G, K, P, H) for _ in range(L)]
    pv = [normal(G, K, P, H) for _ in range(L)]
    sk = [normal(G, M, K, R, H) for _ in range(L)]
    sv = [normal(G, M, K, R, H) for _ in range(L)]
    pvalid = jnp.ones((G, P), bool)
    by_pos = program(attention_keys_by_position, L, args.steps, R)
    last = program(decode_attention, L, args.steps, R)
    pk_t = [jnp.swapaxes(a, -1, -2) for a in pk]
    sk_t = [jnp.swapaxes(a, -1, -2) for a in sk]
    calls = [lambda: by_pos(q, pk, pv, pvalid, sk, sv),
             lambda: last(q, pk_t, pv, pvalid, sk_t, sv)]
    outs = [jax.block_until_ready(c()) for c in calls]
    diff = float(jnp.max(jnp.abs(outs[0] - outs[1])))
    times = [[], []]
    for _ in range(args.repeats):
      for i, c in enumerate(calls):
        t = time.perf_counter()
        jax.block_until_ready(c())
        times[i].append((time.perf_counter() - t) / (args.steps * L) * 1e6)
    base, new = (float(np.median(t)) for t in times)
    print(f"| {G} x {M}, {P}, {R} | {base:.1f} | {new:.1f} | {base / new:.2f}x | {diff:.1e} |",
          flush=True)
    rows.append(dict(shape=(G, M, P, R), baseline_us=base, length_last_us=new, diff=diff))
  print(f"load average {os.getloadavg()[0]:.1f}")
  return rows


if __name__ == "__main__":
  main()
