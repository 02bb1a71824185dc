"""LoRA in the sampler: decode with the adapters unmerged (the base and the adapters as the
trainer holds them, ``x·W + (α/r)·(x·A)·B`` in every adapted projection) vs merged weights
(``models.lora.merge`` once per policy version, as the trainer merges for its sampler:
``train.layout.merge_weight_by_weight``, one jitted program per adapted weight; then the plain
model).

The merged path pays the merge (W + (α/r)·A·B for every adapted weight) each time
the adapters change, i.e. every RL step; the unmerged path pays two thin matmuls per adapted
projection per decoded token. Both decode the same greedy batch; they are timed alternately
(interleaved repeats) so load drift hits both alike, and the greedy tokens are compared.

Usage::

    python scripts/bench_lora.py                       # about 1 minute on 2 CPU cores
    python scripts/bench_lora.py --hidden 1024 --layers 8 --batch 8,64 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rl_jax import models, rollout  # noqa: E402
from rl_jax.train.layout import merge_weight_by_weight  # noqa: E402


def _interleaved(fns, repeats: int) -> list[tuple[float, object]]:
  """Best wall time of each function over ``repeats`` rounds, alternating them within a
  round (after one warm-up call each)."""
  outs = [jax.block_until_ready(fn()) for fn in fns]
  best = [float("inf")] * len(fns)
  for _ in range(repeats):
    for i, fn in enumerate(fns):
      t = time.perf_counter()
      outs[i] = jax.block_until_ready(fn())
      best[i] = min(best[i], time.perf_counter() - t)
  return list(zip(best, outs))


def model(hidden: int, layers: int, rank: int, targets: str) -> tuple:
  """(cfg with adapters, params with non-zero random adapters)."""
  cfg = models.ModelConfig(vocab_size=256, hidden_size=hidden, intermediate_size=3 * hidden,
                           num_layers=layers, num_heads=max(hidden // 64, 1),
                           num_kv_heads=max(hidden // 128, 1), head_dim=64,
                           architecture="qwen3", qk_norm=True, max_position_embeddings=512,
                           lora_rank=rank, lora_alpha=2.0 * rank,
                           lora_targets=models.lora.parse_targets(targets))

  @jax.jit
  def init(key):
    params = models.init_params(cfg, key)
    base, ad = models.lora.split(params)
    ad = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.fold_in(key, x.size),
                                                             x.shape), ad)
    return models.lora.combine(base, ad)

  return cfg, init(jax.random.key(0))


def bench(cfg, params, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
  """Seconds per decode batch: unmerged adapters, merged weights (merge excluded and
  included), and the fraction of equal greedy tokens."""
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(1, cfg.vocab_size, prompt_len)) for _ in range(batch)]
  plain = cfg.replace(lora_rank=0, lora_targets=())
  # the trainer's merge for its sampler (one program per adapted weight)
  merge = merge_weight_by_weight(
      cfg, jax.tree.map(lambda x: x.sharding, models.lora.split(params)[0]))
  merged = jax.block_until_ready(merge(params))
  gen = lambda c, p: rollout.generate(c, p, prompts, n=1, max_new_tokens=new_tokens,
                                      temperature=0.0).tokens
  (t_lora, out_lora), (t_merged, out_merged), (t_merge, _) = _interleaved(
      [lambda: gen(cfg, params), lambda: gen(plain, merged), lambda: merge(params)], repeats)
  tokens = batch * new_tokens
  return {"batch": batch, "unmerged_s": t_lora, "merged_s": t_merged, "merge_s": t_merge,
          "unmerged_tok_s": tokens / t_lora, "merged_tok_s": tokens / t_merged,
          "merged_with_merge_tok_s": tokens / (t_merged + t_merge),
          "same_tokens": float(np.mean(np.asarray(out_lora) == np.asarray(out_merged)))}


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--hidden", type=int, default=512)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--rank", type=int, default=16)
  ap.add_argument("--targets", default="q,k,v,o,gate,up,down")
  ap.add_argument("--batch", default="8,32")
  ap.add_argument("--prompt-len", type=int, default=16)
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=3)
  a = ap.parse_args(argv)
  cfg, params = model(a.hidden, a.layers, a.rank, a.targets)
  print(f"# LoRA decode: unmerged vs merged ({platform.processor() or platform.machine()}, "
        f"{jax.device_count()} {jax.default_backend()} device(s); D={a.hidden}, L={a.layers}, "
        f"r={a.rank}, targets {a.targets}, P={a.prompt_len}, R={a.new_tokens}, greedy)\n")
  print("| batch | unmerged tok/s | merged tok/s | merged + merge per step tok/s | merge s | "
        "same tokens |")
  print("|---|---|---|---|---|---|")
  rows = []
  for b in (int(x) for x in a.batch.split(",")):
    r = bench(cfg, params, b, a.prompt_len, a.new_tokens, a.repeats)
    rows.append(r)
    print(f"| {b} | {r['unmerged_tok_s']:.0f} | {r['merged_tok_s']:.0f} | "
          f"{r['merged_with_merge_tok_s']:.0f} | {r['merge_s']:.4f} | {r['same_tokens']:.3f} |",
          flush=True)
  return rows


if __name__ == "__main__":
  main()
