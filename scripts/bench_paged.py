"""Does a rollout's cost follow the tokens generated or its ``max_new_tokens`` budget?

The same 64 samples (8 prompts x 8 samples of a random 4-layer Llama-style model, temperature
1, an EOS id, so every sample ends long before its budget) are generated with
``max_new_tokens`` = 512 and = 8192, each in its own fresh process (its peak resident memory
is the process's ``ru_maxrss``), the processes alternating round by round. Three settings:

* ``paged 512`` / ``paged 8192``: the paged response cache at its defaults (``page_size``
  64, the pool grown as responses need it); the 8192 / 512 ratios are the claim.
* ``slot 8192``: one page per sample (``page_size`` >= the budget): every sample holds a
  worst-case slot and every decode step reads all of it (the former layout; the baseline).

Each child times ``generate`` after one untimed call (compile excluded) and prints the
tokens' hash, so the three settings are checked to draw identical tokens.

Usage::

    python scripts/bench_paged.py --rounds 3       # about 3 minutes on 2 CPU cores

Reference: Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving
with PagedAttention".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETTINGS = {"paged 512": (512, 64), "paged 8192": (8192, 64), "slot 8192": (8192, 8192)}


def child(max_new: int, page_size: int, repeats: int) -> dict:
  """One setting in this process: best time of ``repeats`` generate calls after a warm-up."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from rl_jax import models, rollout
  from rl_jax.models.config import ModelConfig

  cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=352, num_layers=4,
                    num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=16384,
                    dtype="float32", param_dtype="float32")
  params = models.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 64, size=int(rng.integers(8, 17))).tolist() for _ in range(8)]
  run = lambda: rollout.generate(cfg, params, prompts, n=8, max_new_tokens=max_new,
                                 temperature=1.0, eos_id=0, seed=1, page_size=page_size)
  out = run()
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    out = run()
    best = min(best, time.perf_counter() - t)
  toks = np.where(out.mask, out.tokens, -1)[:, :int(out.lengths.max())]
  return dict(seconds=best, rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              tokens_sha=hashlib.sha256(np.ascontiguousarray(toks).tobytes()).hexdigest()[:16],
              mean_len=float(out.lengths.mean()), max_len=int(out.lengths.max()),
              peak_pages=out.stats["kv_pages_used_peak"], kv_bytes=int(out.stats["kv_bytes"]),
              decode_buckets=out.stats["decode_buckets"])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=3, help="fresh processes per setting")
  ap.add_argument("--repeats", type=int, default=3, help="timed calls per process")
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    max_new, page = map(int, args.child.split(","))
    print("@@", json.dumps(child(max_new, page, args.repeats)), flush=True)
    return
  runs = {name: [] for name in SETTINGS}
  for r in range(args.rounds):
    for name, (max_new, page) in SETTINGS.items():
      p = subprocess.run([sys.executable, __file__, "--child", f"{max_new},{page}",
                          "--repeats", str(args.repeats)], capture_output=True, text=True,
                         check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
      line = next(l for l in p.stdout.splitlines() if l.startswith("@@"))
      runs[name].append(json.loads(line[3:]))
      print(f"round {r} {name}: {runs[name][-1]}", flush=True)
  med = lambda name, k: sorted(x[k] for x in runs[name])[len(runs[name]) // 2]
  shas = {x["tokens_sha"] for v in runs.values() for x in v}
  print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"{args.rounds} rounds, best of {args.repeats} calls each, medians over rounds")
  first = runs["paged 512"][0]
  print(f"64 samples, mean length {first['mean_len']:.0f}, longest {first['max_len']}; "
        f"tokens identical across settings: {len(shas) == 1}")
  print("| setting | time (s) | peak RSS (MiB) | KV bytes held | decode programs |")
  print("|---|---|---|---|---|")
  for name in SETTINGS:
    print(f"| {name} | {med(name, 'seconds'):.3f} | {med(name, 'rss_mib'):.0f} | "
          f"{med(name, 'kv_bytes')} | {med(name, 'decode_buckets'):.0f} |")
  for name in ("paged 8192", "slot 8192"):
    print(f"{name} / paged 512: time {med(name, 'seconds') / med('paged 512', 'seconds'):.2f}x, "
          f"peak RSS {med(name, 'rss_mib') / med('paged 512', 'rss_mib'):.2f}x")


if __name__ == "__main__":
  main()
