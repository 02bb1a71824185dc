"""The RL update's model variants: fused SwiGLU MLP and unrolled layers vs the plain model.

One GRPO-style policy update — ``-(adv * logp * mask).sum() / mask.sum()`` over
``models.response_logprobs`` (packed prompt-once layout), forward + backward +
``optax.adam``, jitted with params and optimizer state donated — on the random Qwen3-style
policy of ``bench_step.py`` / ``bench_tunix.py`` (hidden 256, 4 layers, 4 query / 2 KV heads
of 64, MLP 896, 256-symbol vocabulary: 3.7M parameters), 1 prompt of 9 tokens x ``--samples`` 16
x ``--length`` 64 tokens. Variants (``ModelConfig`` fields):

* ``plain``: ``fused_mlp=False, scan_layers=True`` (two gate/up matmuls, autodiff, layer scan);
* ``fused``: ``fused_mlp=True`` (``transformer.swiglu_mlp``; the CPU default since 2026-11-28);
* ``unrolled``: ``scan_layers=False``; ``fused+unrolled``: both;
* ``concat``: ``prefix_attention="concat"`` (``transformer.concat_prefix_attention``);
  ``fused+concat``: with ``fused_mlp=True``;
* ``fused+concat+unrolled``, ``fused+concat+remat_dots``, ``fused+concat+remat_full``:
  ``fused+concat`` with ``scan_layers=False``, ``remat="dots"`` or ``remat="full"``;
* ``fused+concat+xla_reductions``: ``fused+concat`` compiled with
  ``compile_options.CPU_XLA_REDUCTIONS`` (``train.cpu_xla_reductions``: YNNPACK fuses the
  matmuls only, XLA's loops do the reductions);
* ``fused+concat+xla_reductions+temp_blocks``: that, with the temporaries in blocks of at most
  16 MiB (``train.cpu_temp_block_mib=16``), which glibc's malloc reuses between calls.

Before timing, every variant's loss and gradients are compared with the first variant
named (``plain`` by default; max abs difference printed). Reported: the first call (compile
included), then the median and the worst of ``--repeats`` interleaved calls (each on a fresh
copy of the same initial state), and the median count of the process's minor page faults
during a call (memory the kernel maps in and zeroes).

Usage::

    python scripts/bench_update.py --repeats 7
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from rl_jax import compile_options, models  # noqa: E402

VARIANTS = {"plain": dict(fused_mlp=False, scan_layers=True),
            "fused": dict(fused_mlp=True, scan_layers=True),
            "unrolled": dict(fused_mlp=False, scan_layers=False),
            "fused+unrolled": dict(fused_mlp=True, scan_layers=False),
            "concat": dict(fused_mlp=False, prefix_attention="concat"),
            "fused+concat": dict(fused_mlp=True, prefix_attention="concat"),
            "fused+concat+unrolled": dict(fused_mlp=True, prefix_attention="concat",
                                          scan_layers=False),
            "fused+concat+remat_dots": dict(fused_mlp=True, prefix_attention="concat",
                                            remat="dots"),
            "fused+concat+remat_full": dict(fused_mlp=True, prefix_attention="concat",
                                            remat="full"),
            "fused+concat+xla_reductions": dict(
                fused_mlp=True, prefix_attention="concat",
                compiler_options=compile_options.CPU_XLA_REDUCTIONS),
            "fused+concat+xla_reductions+temp_blocks": dict(
                fused_mlp=True, prefix_attention="concat",
                compiler_options={**compile_options.CPU_XLA_REDUCTIONS,
                                  **compile_options.temp_block_options(16)})}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--samples", type=int, default=16)
  ap.add_argument("--length", type=int, default=64)
  ap.add_argument("--hidden", type=int, default=256)
  ap.add_argument("--layers", type=int, default=4)
  args = ap.parse_args(argv)
  names = args.variants.split(",")
  base = models.ModelConfig(architecture="qwen3", vocab_size=256, hidden_size=args.hidden,
                            intermediate_size=args.hidden * 7 // 2, num_layers=args.layers,
                            num_heads=4, num_kv_heads=2, head_dim=args.hidden // 4,
                            max_position_embeddings=max(128, 9 + args.length),
                            qk_norm=True)
  params = models.init_params(base, jax.random.key(0))
  G, M, P, R = 1, args.samples, 9, args.length
  rng = np.random.default_rng(0)
  pt = jnp.asarray(rng.integers(0, 256, (G, P)), jnp.int32)
  pl = jnp.full((G,), P, jnp.int32)
  rt = jnp.asarray(rng.integers(0, 256, (G, M, R)), jnp.int32)
  rm = jnp.asarray(rng.random((G, M, R)) < 0.95)
  adv = jnp.asarray(rng.normal(size=(G, M, 1)), jnp.float32)
  opt = optax.adam(1e-3)

  def make(cfg, compiler_options=None):
    def loss(p):
      lp = models.response_logprobs(cfg, p, pt, pl, rt, rm, shared_prefix=True)
      return -(adv * lp * rm).sum() / rm.sum()

    def step(p, o):
      value, grads = jax.value_and_grad(loss)(p)
      updates, o = opt.update(grads, o, p)
      return optax.apply_updates(p, updates), o, value

    return (jax.jit(step, donate_argnums=(0, 1), compiler_options=compiler_options),
            jax.jit(jax.value_and_grad(loss), compiler_options=compiler_options))

  def fresh():
    p = jax.tree.map(jnp.copy, params)
    o = opt.init(p)
    return jax.block_until_ready((p, o))

  steps, grads, first = {}, {}, {}
  for name in names:
    fields = dict(VARIANTS[name])
    options = fields.pop("compiler_options", None)
    steps[name], grad_fn = make(base.replace(**fields), options)
    p, o = fresh()
    t0 = time.perf_counter()
    jax.block_until_ready(steps[name](p, o))
    first[name] = time.perf_counter() - t0
    grads[name] = grad_fn(params)
  ref = grads[names[0]]
  diff = {n: max(float(jnp.max(jnp.abs(a - b))) for a, b in
                 zip(jax.tree.leaves(grads[n]), jax.tree.leaves(ref))) for n in names}
  times, faults = {n: [] for n in names}, {n: [] for n in names}
  minor_faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(args.repeats):
    for n in names:
      p, o = fresh()
      f0, t0 = minor_faults(), time.perf_counter()
      jax.block_until_ready(steps[n](p, o))
      times[n].append(time.perf_counter() - t0)
      faults[n].append(minor_faults() - f0)
  med = {n: float(np.median(t)) for n, t in times.items()}
  print(f"policy: {base.num_params() / 1e6:.2f}M parameters, {M} x ({P} + {R}) tokens; "
        f"JAX {jax.__version__} {jax.default_backend()}; {os.cpu_count()} CPUs; load average "
        f"{os.getloadavg()[0]:.1f}")
  print(f"| variant | first call (s) | update, median (ms) | worst (ms) | vs {names[0]} | "
        f"max abs diff of loss and grads vs {names[0]} | page faults per call, median |")
  print("|---|---|---|---|---|---|---|")
  for n in names:
    print(f"| {n} | {first[n]:.1f} | {med[n] * 1e3:.0f} | {max(times[n]) * 1e3:.0f} | "
          f"{med[names[0]] / med[n]:.2f}x | {diff[n]:.1e} | {np.median(faults[n]):.0f} |")
  return {"first_s": first, "median_s": med, "times_s": times, "max_diff": diff,
          "faults": faults}


if __name__ == "__main__":
  main()
