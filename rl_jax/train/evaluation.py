"""Held-out evaluation: greedy accuracy, and pass@k at the rollout temperature."""

from __future__ import annotations

import numpy as np

from rl_jax.train.context import Setup
from rl_jax.train.rollouts import decode, encode_prompts, generate, score
from rl_jax.train.streams import Stream, seed_for

__all__ = ["evaluate"]


def evaluate(s: Setup, params, step: int) -> dict[str, float]:
  """``eval_accuracy`` (greedy, reward >= 1) on the eval split, and ``eval_pass@k`` (any of k
  samples correct) if ``eval.pass_k`` > 0; the pass@k draws use the EVAL_PASS_K stream of
  ``step``."""
  c = s.config
  examples = s.eval_examples
  answers = [e.answer for e in examples]
  prompts = encode_prompts(s, examples)
  out = generate(s, params, prompts, n=1, temperature=0.0, seed=0)
  rewards, _ = score(s, decode(s, np.asarray(out.tokens), np.asarray(out.mask)), answers)
  result = {"eval_accuracy": float(np.mean(rewards >= 1.0))}
  k = c.eval.pass_k
  if k > 0:
    out = generate(s, params, prompts, n=k, temperature=c.rollout.temperature or 1.0,
                   seed=seed_for(c.train.seed, step, Stream.EVAL_PASS_K))
    r, _ = score(s, decode(s, np.asarray(out.tokens), np.asarray(out.mask)),
                 [a for a in answers for _ in range(k)])
    result[f"eval_pass@{k}"] = float(np.mean((r.reshape(len(examples), k) >= 1.0).any(axis=1)))
  return result
