"""One scoring pass for ``top_logprobs`` (and log-probs of greedy choices).

The engine records the log-prob of each sampled token under the distribution it was drawn
from, but not the alternatives. ``top_logprobs`` runs the model once over prompt + completion
(``models.forward``, padded to a power of two; the model is causal, so padding at the end
changes nothing before it) and reads, at each completion position, the k most likely tokens
of the same distribution: the logits divided by the temperature with top-k/top-p applied
(``sampling.filter_logits``). A greedy choice (temperature 0) was drawn from a point mass;
its log-probs and alternatives are reported under the model's plain softmax instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import models
from rl_jax.rollout import sampling as sampling_lib
from rl_jax.rollout.records import pow2

__all__ = ["top_logprobs"]


@functools.partial(jax.jit, static_argnames=("cfg", "k", "filtered"))
def _score(cfg, params, tokens, temperature, top_k, top_p, *, k: int, filtered: bool):
  """tokens int32 [1,T] -> (log-prob of each next token float32 [T-1], top-k values
  float32 [T,k] and ids int32 [T,k] of the distribution at every position)."""
  logits = models.forward(cfg, params, tokens)[0].astype(jnp.float32)
  if filtered:
    z = sampling_lib.filter_logits(logits, temperature, top_k, top_p)
  else:
    z = logits / temperature
  logp = jax.nn.log_softmax(z, axis=-1)
  chosen = jnp.take_along_axis(logp[:-1], tokens[0, 1:, None], axis=-1)[:, 0]
  vals, ids = jax.lax.top_k(logp, k)
  return chosen, vals, ids


def top_logprobs(cfg, params, prompt: list[int], completion: list[int], sampling, k: int):
  """Log-probs of ``completion`` after ``prompt`` and the top ``k`` alternatives per token.

  Args:
    cfg, params: the served model. prompt, completion: token ids. sampling:
      ``scheduler.Sampling``. k: alternatives per position (0: none).
  Returns:
    (list of float per completion token, list of [(id, log-prob), ...] per completion token;
    alternatives outside the top-k/top-p set are left out).
  """
  if not completion:
    return [], []
  ids = list(prompt) + list(completion)
  T = pow2(len(ids), 16)
  tokens = np.zeros((1, T), np.int32)
  tokens[0, :len(ids)] = ids
  greedy = sampling.temperature <= 0
  temp = 1.0 if greedy else float(sampling.temperature)
  filtered = not greedy and (sampling.top_k > 0 or sampling.top_p < 1.0)
  chosen, vals, top = jax.device_get(_score(
      cfg, params, jnp.asarray(tokens), jnp.float32(temp), jnp.int32(sampling.top_k),
      jnp.float32(sampling.top_p), k=max(int(k), 1), filtered=filtered))
  start, stop = len(prompt) - 1, len(ids) - 1  # position p predicts token p + 1
  lps = [float(x) for x in chosen[start:stop]]
  alts = [[(int(i), float(v)) for i, v in zip(top[p, :k], vals[p, :k]) if np.isfinite(v)]
          for p in range(start, stop)]
  return lps, alts
