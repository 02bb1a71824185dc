"""Held-out evaluation: greedy accuracy, and pass@k at the rollout temperature.

With ``eval.share_programs`` (default) the evaluation samples through the training rollouts'
compiled programs instead of compiling its own: the held-out prompts go through in batches
of the training batch's G groups with the same samples per prompt M (``Setup.geometry``). Greedy accuracy reads the first of the M
identical greedy samples; pass@k (k <= M) the first k samples, which are exactly the k a
separate pass would draw (every sample has its own key stream). The price is M greedy rows
per prompt instead of one: cheap for small models, not for long generations with a large
model (``configs/gsm8k_hf.py`` turns it off).
"""

from __future__ import annotations

import numpy as np

from rl_jax.train import agent_stage
from rl_jax.train.context import Setup
from rl_jax.train.rollouts import decode, encode_prompts, generate, score
from rl_jax.train.streams import Stream, seed_for

__all__ = ["evaluate", "first_samples"]


def first_samples(tokens: np.ndarray, mask: np.ndarray, n: int,
                  k: int) -> tuple[np.ndarray, np.ndarray]:
  """The first ``k`` of each group's ``n`` rows: tokens / mask [G·n,R] -> [G·k,R]."""
  R = tokens.shape[-1]
  pick = lambda a: np.asarray(a).reshape(-1, n, R)[:, :k].reshape(-1, R)
  return pick(tokens), pick(mask)


def _sample(s: Setup, params, prompts, k: int, temperature: float, seed: int):
  """``k`` samples per prompt (tokens, mask [G·k,R]), on the training programs if shared:
  chunks of exactly the training batch's G groups (the last one padded with copies of its
  last prompt, dropped after), M samples each, prompt ``i`` on key stream ``i``."""
  G, M = s.geometry.rows, s.geometry.row_size  # (W, m) with adaptive group size
  if not (s.eval.share_programs and k <= M):
    out = generate(s, params, prompts, s.model_cfg, n=k, temperature=temperature, seed=seed)
    return np.asarray(out.tokens), np.asarray(out.mask)
  tokens, mask = [], []
  for lo in range(0, len(prompts), G):
    chunk = list(prompts[lo:lo + G])
    real = len(chunk)
    out = generate(s, params, chunk + [chunk[-1]] * (G - real), s.model_cfg, n=M,
                   temperature=temperature,
                   seed=seed, first_index=lo)
    t, m = first_samples(out.tokens, out.mask, M, k)
    tokens.append(t[:real * k])
    mask.append(m[:real * k])
  return np.concatenate(tokens), np.concatenate(mask)


def evaluate(s: Setup, params, step: int, agent=None) -> dict[str, float]:
  """``eval_accuracy`` (greedy, reward >= 1) on the eval split, and ``eval_pass@k`` (any of k
  samples correct) if ``eval.pass_k`` > 0; the pass@k draws use the EVAL_PASS_K stream of
  ``step``. Multi-turn runs (``agent``: the greedy ``AgentEngine``): the success rate of
  greedy episodes and ``eval_turns_mean`` (``agent_stage.evaluate``)."""
  if agent is not None:
    return agent_stage.evaluate(s, agent, params)
  examples = s.eval_examples
  answers = [e.answer for e in examples]
  prompts = encode_prompts(s, examples)
  tokens, mask = _sample(s, params, prompts, 1, 0.0, 0)
  rewards, _ = score(s, decode(s, tokens, mask), answers)
  result = {"eval_accuracy": float(np.mean(rewards >= 1.0))}
  k = s.eval.pass_k
  if k > 0:
    tokens, mask = _sample(s, params, prompts, k, s.rollout.sample_temperature,
                           seed_for(s.train.seed, step, Stream.EVAL_PASS_K))
    r, _ = score(s, decode(s, tokens, mask), [a for a in answers for _ in range(k)])
    result[f"eval_pass@{k}"] = float(np.mean((r.reshape(len(examples), k) >= 1.0).any(axis=1)))
  return result
