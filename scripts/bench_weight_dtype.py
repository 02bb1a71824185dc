"""Low-precision rollouts (``rollout.weight_dtype``): sampling speed with the policy's own
weights against int8 / fp8 projections, interleaved in one process, and the gap between the
two policies on the tokens the quantised sampler drew.

One random dense model (default: 4 layers, d = 256, a Llama shape), G prompts of P random
tokens, M samples each, R new tokens at temperature 1 with no EOS (every sample runs the
whole budget). Each round runs every variant once, in turn, after one untimed warm-up call
each (the compiles). Reported per variant: median seconds per ``rollout.generate`` call and
tokens per second, the bytes of the weights, and for the quantised variants the mismatch the
trainer would log (mean and max over tokens of |log μ − log π|: the quantised sampler's
log-prob against the float policy's teacher-forced log-prob of the same token, the trainer's
``mismatch_*`` metrics) and its mean ``log μ − log π`` (a one-sample KL estimate).

Usage::

    python scripts/bench_weight_dtype.py --rounds 5
    python scripts/bench_weight_dtype.py --hidden 512 --layers 8 --dtypes int8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rl_jax import models, rollout  # noqa: E402
from rl_jax.train import memory  # noqa: E402


def model(hidden: int, layers: int, vocab: int) -> models.ModelConfig:
  heads = max(hidden // 64, 1)
  return models.ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=hidden,
                            intermediate_size=hidden * 8 // 3 // 64 * 64, num_layers=layers,
                            num_heads=heads, num_kv_heads=max(heads // 2, 1),
                            head_dim=64, max_position_embeddings=1024)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--hidden", type=int, default=256)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=4096)
  ap.add_argument("--groups", type=int, default=8, help="G prompts")
  ap.add_argument("--samples", type=int, default=8, help="M samples per prompt")
  ap.add_argument("--prompt-tokens", type=int, default=32)
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--dtypes", default="int8,fp8", help="quantised variants, comma-separated")
  args = ap.parse_args(argv)

  cfg = model(args.hidden, args.layers, args.vocab)
  params = models.init_params(cfg, jax.random.key(0), std=0.05)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, args.vocab, args.prompt_tokens).tolist()
             for _ in range(args.groups)]
  variants = {"float32": (cfg, params)}
  for q in [d for d in args.dtypes.split(",") if d]:
    qcfg = cfg.replace(quant=q, quant_block=cfg.head_dim)
    variants[q] = (qcfg, jax.block_until_ready(jax.jit(
        lambda p, c=qcfg: models.quant.quantize_base(c, p))(params)))

  def run(name):
    c, p = variants[name]
    t0 = time.perf_counter()
    out = rollout.generate(c, p, prompts, n=args.samples, max_new_tokens=args.new_tokens,
                           temperature=1.0, eos_id=None, seed=0)
    jax.block_until_ready(out.tokens)
    return time.perf_counter() - t0, out

  outs, times = {}, {name: [] for name in variants}
  for name in variants:
    _, outs[name] = run(name)  # warm-up: the compiles
  for _ in range(args.rounds):
    for name in variants:
      times[name].append(run(name)[0])

  tokens = args.groups * args.samples * args.new_tokens
  base = statistics.median(times["float32"])
  print(f"model: llama d={args.hidden} L={args.layers} V={args.vocab}; G={args.groups} x "
        f"M={args.samples} samples, P={args.prompt_tokens}, R={args.new_tokens}; "
        f"{args.rounds} interleaved rounds; jax {jax.__version__} on {jax.default_backend()}")
  print(f"{'weights':>8} {'s/call':>8} {'tokens/s':>9} {'vs float32':>10} {'weight MiB':>10} "
        f"{'|dlogp| mean':>12} {'max':>7} {'KL est.':>8}")
  for name, (c, p) in variants.items():
    med = statistics.median(times[name])
    row = (f"{name:>8} {med:>8.3f} {tokens / med:>9.0f} {base / med:>9.2f}x "
           f"{memory.tree_bytes(p, host=None) / 2**20:>10.2f}")
    if name != "float32":
      o = outs[name]
      G, M, R = args.groups, args.samples, args.new_tokens
      pt = np.zeros((G, args.prompt_tokens), np.int32)
      pt[:] = np.asarray(prompts)
      pl = np.full((G,), args.prompt_tokens, np.int32)
      toks = np.asarray(o.tokens).reshape(G, M, R)
      mask = np.asarray(o.mask).reshape(G, M, R).astype(bool)
      pi = np.asarray(models.response_logprobs(cfg, params, pt, pl, toks, mask))
      mu = np.asarray(o.logprobs).reshape(G, M, R)
      gap = (mu - pi)[mask]
      row += f" {np.abs(gap).mean():>12.5f} {np.abs(gap).max():>7.4f} {gap.mean():>8.5f}"
    print(row)


if __name__ == "__main__":
  main()
