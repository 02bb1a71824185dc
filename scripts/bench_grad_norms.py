"""Per-trajectory gradient norms for VCPO's OPOB: exact and cheaper methods, timed in one run.

Model: a small decoder-like log-prob function (embedding, two residual MLP blocks with a
causal running-mean token mixer, LM head). Baseline: a Python loop of one jitted backward
pass per row. Reported: median wall time per call and the relative error against the exact
norms.

    python scripts/bench_grad_norms.py [--batch 16 --length 32 --width 64 --vocab 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import losses


def make_model(key, d, v, layers=2):
  ks = jax.random.split(key, 2 + 2 * layers)
  params = dict(emb=jax.random.normal(ks[0], (v, d)) * 0.5,
                head=jax.random.normal(ks[1], (d, v)) / np.sqrt(d),
                blocks=[dict(w1=jax.random.normal(ks[2 + 2 * i], (d, 4 * d)) / np.sqrt(d),
                             w2=jax.random.normal(ks[3 + 2 * i], (4 * d, d)) / np.sqrt(4 * d))
                        for i in range(layers)])

  def hidden(p, tokens):
    x = p["emb"][tokens]
    t = tokens.shape[-1]
    for blk in p["blocks"]:
      mix = jnp.cumsum(x, axis=-2) / jnp.arange(1, t + 1)[:, None]  # causal mean mixer
      x = x + jax.nn.gelu((x + mix) @ blk["w1"]) @ blk["w2"]
    return x

  def row_logp(p, inp):
    tokens, targets, mask = inp
    lp = jax.nn.log_softmax(hidden(p, tokens) @ p["head"], axis=-1)
    tok = jnp.take_along_axis(lp, targets[..., None], -1)[..., 0]
    return jnp.sum(jnp.where(mask, tok, 0.0), axis=-1)

  return params, row_logp, hidden


def timeit(fn, reps):
  jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--length", type=int, default=32)
  ap.add_argument("--width", type=int, default=64)
  ap.add_argument("--vocab", type=int, default=256)
  ap.add_argument("--probes", type=int, default=8)
  ap.add_argument("--reps", type=int, default=5)
  args = ap.parse_args()
  b, t, d, v = args.batch, args.length, args.width, args.vocab
  params, fn, hidden = make_model(jax.random.key(0), d, v)
  k1, k2 = jax.random.split(jax.random.key(1))
  tokens = jax.random.randint(k1, (b, t), 0, v)
  targets = jax.random.randint(k2, (b, t), 0, v)
  mask = jnp.arange(t)[None] < jax.random.randint(jax.random.key(2), (b, 1), t // 4, t + 1)
  inp = (tokens, targets, mask)
  n_params = sum(x.size for x in jax.tree.leaves(params))

  row_grad = jax.jit(lambda p, row: jax.tree.map(
      lambda g: jnp.sum(g ** 2), jax.grad(lambda q: fn(q, row)[0])(p)))

  def loop():
    return jnp.stack([sum(jax.tree.leaves(row_grad(params, jax.tree.map(lambda x: x[i:i + 1],
                                                                         inp))))
                      for i in range(b)])

  norms = jax.jit(losses.per_row_grad_sq_norms, static_argnums=0,
                  static_argnames=("method", "chunk_size", "num_probes"))
  head = jax.jit(lambda p: losses.head_grad_sq_norms(
      hidden(p, tokens), hidden(p, tokens) @ p["head"], targets, mask))
  methods = {
      "loop of per-row grads (baseline)": loop,
      "vmap (exact)": lambda: norms(fn, params, inp, method="vmap"),
      "map, chunk 4 (exact)": lambda: norms(fn, params, inp, method="map", chunk_size=4),
      f"jvp sketch, K={args.probes} (unbiased)": lambda: norms(
          fn, params, inp, method="jvp", num_probes=args.probes, key=jax.random.key(3)),
      "head ghost norm (exact for head only)": lambda: head(params),
  }
  exact = np.asarray(norms(fn, params, inp, method="vmap"))
  base = None
  print(f"B={b} T={t} D={d} V={v} params={n_params}  device={jax.devices()[0].platform}")
  print("| method | ms / call | speed-up vs loop | rel. error (median over rows) |")
  print("|---|---|---|---|")
  for name, f in methods.items():
    sec = timeit(f, args.reps)
    base = sec if base is None else base
    err = np.median(np.abs(np.asarray(f()) - exact) / exact)
    print(f"| {name} | {sec * 1e3:.1f} | {base / sec:.2f}x | {err:.3f} |")


if __name__ == "__main__":
  main()
