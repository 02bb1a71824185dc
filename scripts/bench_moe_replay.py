"""Train<->sampler mismatch of a mixture-of-experts policy, with and without router replay.

The sampler (``rollout.generate``, KV cache, one token per decode step) and the trainer
(``models.response_logprobs``, packed prompt-once layout, every token in one pass) compute
the same function with different kernels and reduction orders. In bfloat16 their router
logits differ by rounding, a token near a tie between two experts goes to different
experts, and its log-prob jumps. This script samples responses in bfloat16, recomputes
their log-probs as the trainer does (bfloat16 compute, float32 weights) and reports, for
the trainer routing by itself and for router replay (``routing=`` the sampler's records):

  routing_mismatch  fraction of response tokens whose expert set differs in some MoE layer
                    between sampler and trainer (the trainer metric of the same name)
  |Δ logp| mean / max   over the response tokens, trainer minus sampler log-prob
  ratio > 1±0.2     fraction of tokens whose trainer/sampler probability ratio leaves the
                    PPO clip range

Usage::

    python scripts/bench_moe_replay.py                       # random-init Qwen3-MoE-shaped model
    python scripts/bench_moe_replay.py --hf=DIR/hf           # e.g. configs/moe_quickstart.py's output
    python scripts/bench_moe_replay.py --quick               # toy sizes, seconds

References: Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training
and Inference Routers" (rollout routing replay, R3).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import models, rollout
from rl_jax.train.steps import routing_mismatch


def small_moe(quick: bool) -> models.ModelConfig:
  """A Qwen3-MoE-shaped model: all layers MoE, softmax top-X router, renormalised."""
  if quick:
    return models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=8, architecture="qwen3_moe",
                              qk_norm=True, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=16, norm_topk_prob=True,
                              sparse_layers=(True, True), max_position_embeddings=128)
  return models.ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4,
                            num_heads=8, num_kv_heads=2, head_dim=32, architecture="qwen3_moe",
                            qk_norm=True, num_experts=32, num_experts_per_tok=4,
                            moe_intermediate_size=128, norm_topk_prob=True,
                            sparse_layers=(True,) * 4, max_position_embeddings=512)


def measure(cfg: models.ModelConfig, params, prompts: list[list[int]], n: int, new_tokens: int,
            seed: int = 0) -> dict:
  """Sample in bfloat16, recompute as the trainer (bfloat16 compute) with and without
  replay; returns {"no_replay": {...}, "replay": {...}, "tokens": int}."""
  bf = cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
  out = rollout.generate(bf, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), prompts,
                         n=n, max_new_tokens=new_tokens, temperature=1.0, seed=seed)
  G, M, R = len(prompts), n, new_tokens
  P = max(map(len, prompts))
  pt = np.zeros((G, P), np.int32)
  for g, p in enumerate(prompts):
    pt[g, :len(p)] = p
  pl = np.asarray([len(p) for p in prompts], np.int32)
  rt = out.tokens.reshape(G, M, R)
  mask = out.mask.reshape(G, M, R)
  recorded = out.routing.reshape(G, M, R, *out.routing.shape[2:])
  train_cfg = cfg.replace(dtype="bfloat16", param_dtype="float32")
  fn = jax.jit(lambda p, r: models.response_logprobs(train_cfg, p, pt, pl, rt, mask, routing=r,
                                                     return_routing=True))
  behaviour = out.logprobs.reshape(G, M, R)
  res = {"tokens": int(mask.sum())}
  for name, routing in (("no_replay", None), ("replay", recorded)):
    lp, used = fn(params, routing)
    d = np.abs(np.asarray(lp) - behaviour)[mask]
    ratio = np.exp((np.asarray(lp) - behaviour)[mask])
    res[name] = {
        "routing_mismatch": float(routing_mismatch(used, recorded, jnp.asarray(mask))),
        "dlogp_mean": float(d.mean()), "dlogp_max": float(d.max()),
        "outside_clip": float(np.mean((ratio < 0.8) | (ratio > 1.2)))}
  return res


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--hf", default=None, help="an HF Qwen3-MoE checkpoint directory")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--n", type=int, default=8)
  ap.add_argument("--new_tokens", type=int, default=32)
  ap.add_argument("--json", default=None, help="write the results here")
  a = ap.parse_args(argv)
  if a.hf:
    cfg, params = models.load_hf(a.hf, dtype=jnp.float32)
  else:
    cfg = small_moe(a.quick)
    params = models.init_params(cfg, jax.random.key(0), std=0.05)
  G, n, R = (2, 2, 4) if a.quick else (a.prompts, a.n, a.new_tokens)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, cfg.vocab_size, int(rng.integers(4, 12))).tolist()
             for _ in range(G)]
  t0 = time.perf_counter()
  res = measure(cfg, params, prompts, n, R)
  res.update(model=a.hf or "random init", experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
             moe_layers=len(cfg.moe_layers), seconds=round(time.perf_counter() - t0, 1))
  print(f"{res['tokens']} response tokens; {cfg.num_experts} experts, top {cfg.num_experts_per_tok}, "
        f"{len(cfg.moe_layers)} MoE layers; sampler bfloat16, trainer bfloat16 compute")
  print("| trainer routing | routing_mismatch | mean |Δ logp| | max |Δ logp| | ratio outside [0.8, 1.2] |")
  print("|---|---|---|---|---|")
  for name in ("no_replay", "replay"):
    r = res[name]
    print(f"| {name.replace('_', ' ')} | {r['routing_mismatch']:.4f} | {r['dlogp_mean']:.4f} | "
          f"{r['dlogp_max']:.3f} | {r['outside_clip']:.4f} |")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(res, f, indent=1)
  return res


if __name__ == "__main__":
  main()
