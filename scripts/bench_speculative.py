"""Where SPEC-RL's speculative rollouts pay: speed-up over plain sampling by model width and
response length, at a fixed policy drift.

Each cell (width D, response length R) builds a random Qwen3-style policy q (4 layers,
vocabulary 512, D/64 heads of 64, MLP 3·D), samples G x M responses from it (the drafts,
with q's full sampling distributions, as the trainer stores them), and a policy p = q with
every weight scaled by (1 + s·ε), ε ~ N(0, 1) (``--drift`` s: the policy moved since the
drafts were drawn). Then, interleaved over ``--repeats`` rounds, it times:

* **plain**: ``rollout.generate`` of M responses per prompt from p (no EOS: every response
  is R tokens, the decode-heavy end of RL rollouts);
* **speculative**: what the trainer's SPEC-RL step does (``train.speculative_stage.roll``):
  p's teacher-forced pass over the drafts (``speculative.sampling_logprobs``), acceptance and
  residual draws (``speculative.speculate``), decoding on from each accepted prefix
  (``speculative.complete_prefixes``), and p's pass over the new responses to store them as
  the next drafts (skipped only when every draft is kept whole).

It reports median seconds of each, the speed-up, the fraction of response tokens reused
and the longest decode the resume still had to run (the batch decodes until its last row
is done). Speculative sampling is exact for any p and q (``tests/test_speculative.py``);
this script measures cost only. Compilation is excluded (one warm-up call of each, and
the engine's ``warmup`` of every resume shape).

Usage::

    python scripts/bench_speculative.py                       # 3 widths x 3 lengths
    python scripts/bench_speculative.py --drifts 0,1e-5,1e-4,1e-3 --widths 256 --lengths 64

References: SPEC-RL (speculative rollouts for RL post-training, 2025); Leviathan et al.
2023; Chen et al. 2023.
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

from rl_jax import models, rollout  # noqa: E402
from rl_jax.rollout import speculative  # noqa: E402
from rl_jax.rollout.engine import RolloutEngine  # noqa: E402
from rl_jax.rollout.records import pow2  # noqa: E402

VOCAB, LAYERS, PROMPT_LEN = 512, 4, 16


def policy_pair(width: int, drift: float, seed: int = 0):
  """(cfg, q, p): random policy q and p = q · (1 + drift·ε) elementwise."""
  cfg = models.ModelConfig(architecture="qwen3", vocab_size=VOCAB, hidden_size=width,
                           intermediate_size=3 * width, num_layers=LAYERS,
                           num_heads=max(1, width // 64), num_kv_heads=max(1, width // 128),
                           head_dim=64 if width >= 64 else width, qk_norm=True,
                           max_position_embeddings=1024)
  q = models.init_params(cfg, jax.random.key(seed), std=0.05)
  leaves, tree = jax.tree.flatten(q)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  p = jax.tree.unflatten(tree, [x * (1 + drift * jax.random.normal(k, x.shape, x.dtype))
                                for x, k in zip(leaves, keys)])
  return cfg, q, p


def _padded(prompts):
  return (jnp.asarray(np.asarray(prompts, np.int32)),
          jnp.full((len(prompts),), len(prompts[0]), jnp.int32))


def make_drafts(cfg, q, prompts, m: int, r: int, seed: int) -> dict:
  """Drafts as the trainer keeps them: tokens [G,M,R], lengths [G·M], q's log-probs
  [G·M,R,V]."""
  out = rollout.generate(cfg, q, prompts, n=m, max_new_tokens=r, temperature=1.0, seed=seed)
  tokens = np.asarray(out.tokens).reshape(len(prompts), m, r)
  pt, pl = _padded(prompts)
  logq = np.asarray(speculative.sampling_logprobs(cfg, q, pt, pl, jnp.asarray(tokens), 1.0,
                                                  0, 1.0, filtered=False))
  return {"tokens": tokens, "length": np.asarray(out.mask).sum(axis=1),
          "logq": logq.reshape(len(prompts) * m, r, -1)}


def plain(cfg, p, prompts, m: int, r: int, seed: int):
  out = rollout.generate(cfg, p, prompts, n=m, max_new_tokens=r, temperature=1.0, seed=seed)
  return jax.block_until_ready(out.tokens)


def speculative_rollout(cfg, p, prompts, drafts: dict, m: int, r: int, seed: int) -> dict:
  """One SPEC-RL rollout from ``drafts`` (the trainer's ``roll`` without its state)."""
  g = len(prompts)
  pt, pl = _padded(prompts)
  rows = lambda toks: np.asarray(speculative.sampling_logprobs(
      cfg, p, pt, pl, jnp.asarray(toks), 1.0, 0, 1.0, filtered=False))
  p_all = rows(drafts["tokens"])
  sp = speculative.speculate(drafts["tokens"].reshape(g * m, r), drafts["length"],
                             p_all.reshape(g * m, r, -1), drafts["logq"],
                             np.random.default_rng(seed), eos_ids=[], max_new_tokens=r)
  out = speculative.complete_prefixes(cfg, p, prompts, sp, n=m, max_new_tokens=r,
                                      temperature=1.0, top_p=1.0, top_k=0, eos_id=None,
                                      seed=seed)
  if not (sp.accepted == drafts["length"]).all():  # store the new drafts' distributions
    rows(np.asarray(out.tokens).reshape(g, m, r))
  resumed = [len(t) for t, f in zip(sp.tokens, sp.finished) if f is None]
  return {"reused": float(sp.accepted.sum()) / (g * m * r),
          "longest_decode": r - min(resumed) if resumed else 0}


def bench_cell(width: int, length: int, *, groups: int, samples: int, drift: float,
               repeats: int) -> dict:
  cfg, q, p = policy_pair(width, drift)
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, VOCAB, (groups, PROMPT_LEN)).tolist()
  drafts = make_drafts(cfg, q, prompts, samples, length, seed=1)
  plain(cfg, p, prompts, samples, length, seed=2)  # warm-up (compiles)
  # Every resume shape the engine can meet, compiled once, as a long run's cache holds them.
  RolloutEngine(cfg, n=samples, max_slots=pow2(groups), max_new_tokens=length,
                max_prompt_len=PROMPT_LEN, temperature=1.0, top_p=1.0, top_k=0, eos_id=None,
                seed=0, context=cfg.max_position_embeddings).warmup(p)
  info = speculative_rollout(cfg, p, prompts, drafts, samples, length, seed=2)
  times = {"plain": [], "speculative": []}
  for i in range(repeats):
    for name in times:
      t = time.perf_counter()
      if name == "plain":
        plain(cfg, p, prompts, samples, length, seed=3 + i)
      else:
        info = speculative_rollout(cfg, p, prompts, drafts, samples, length, seed=3 + i)
      times[name].append(time.perf_counter() - t)
  t_plain, t_spec = (float(np.median(times[k])) for k in ("plain", "speculative"))
  return dict(drift=drift, width=width, length=length, params=cfg.num_params(), plain_s=t_plain,
              spec_s=t_spec, speedup=t_plain / t_spec, **info)


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--widths", default="64,256,512")
  ap.add_argument("--lengths", default="16,64,256")
  ap.add_argument("--groups", type=int, default=8)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--drifts", default="1e-3",
                  help="relative weight changes between the drafts' policy and the current one")
  ap.add_argument("--repeats", type=int, default=3)
  args = ap.parse_args(argv)
  print(f"jax {jax.__version__}, {jax.default_backend()}, {os.cpu_count()} cores; "
        f"G={args.groups} x M={args.samples}, {LAYERS} layers, vocabulary {VOCAB}", flush=True)
  rows = []
  cells = [(float(s), int(w), int(r)) for s in args.drifts.split(",")
           for w in args.widths.split(",") for r in args.lengths.split(",")]
  for drift, width, length in cells:
    row = bench_cell(width, length, groups=args.groups, samples=args.samples,
                     drift=drift, repeats=args.repeats)
    rows.append(row)
    print(f"  drift {drift:g} D={width:4d} R={length:4d} ({row['params'] / 1e6:5.2f}M): plain "
          f"{row['plain_s']:.3f}s  speculative {row['spec_s']:.3f}s  "
          f"{row['speedup']:.2f}x  reused {row['reused']:.1%}  longest decode "
          f"{row['longest_decode']}", flush=True)
  print("\n| drift | D | R | parameters | plain s | speculative s | speed-up | tokens reused | "
        "longest resumed decode |\n|---|---|---|---|---|---|---|---|---|")
  for row in rows:
    print(f"| {row['drift']:g} | {row['width']} | {row['length']} | {row['params'] / 1e6:.2f}M | "
          f"{row['plain_s']:.3f} | {row['spec_s']:.3f} | {row['speedup']:.2f}x | "
          f"{row['reused']:.1%} | {row['longest_decode']} |")
  print(f"load average {os.getloadavg()[0]:.1f}")
  return rows


if __name__ == "__main__":
  main()
