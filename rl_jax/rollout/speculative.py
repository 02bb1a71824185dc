"""Speculative rollouts (SPEC-RL): reuse an earlier response of the same prompt as a draft.

The draft of a sample is a response drawn earlier from a policy q (an older policy), stored
with q's full sampling distribution at every draft position. The current policy p scores
the draft in one teacher-forced pass (``sampling_logprobs``); then, position by position,
draft token x is accepted with probability ``min(1, e^l · p(x)/q(x))`` (lenience l). At the
first rejection the replacement token is drawn from the residual ``norm(max(0, p − q))``,
and decoding continues from prompt + accepted prefix + replacement with the current policy
(``complete_prefixes``, the rollout engine's resume path). With l = 0 this is speculative
sampling: every response is distributed exactly as a response sampled from p from scratch,
whatever q is, as long as the draft really was drawn from q.

Axis letters: the legend of ``rl_jax/__init__.py`` (G prompts, M samples per
prompt, B = G·M rows, P prompt bucket, R response length, V vocab).

References: Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"; SPEC-RL (speculative rollouts for RL post-training, 2025).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.models import grouped
from rl_jax.models import transformer as tx
from rl_jax.models.config import ModelConfig
from rl_jax.rollout import sampling
from rl_jax.rollout.engine import RolloutEngine
from rl_jax.rollout.records import GroupRequest, Rollout, Sample, assemble, pow2

__all__ = ["Speculation", "sampling_logprobs", "accept_lengths", "residual_token", "speculate",
           "complete_prefixes"]


@functools.partial(jax.jit, static_argnames=("cfg", "filtered"))
def sampling_logprobs(cfg: ModelConfig, params, prompt_tokens, prompt_lengths, response_tokens,
                      temperature, top_k, top_p, filtered: bool = True) -> jax.Array:
  """Log-probs of the full sampling distribution (tempered, top-k / top-p filtered) at every
  response position, in one teacher-forced pass.

  Args:
    prompt_tokens int32 [G,P] right-padded; prompt_lengths int32 [G];
    response_tokens int32 [G,M,R]; temperature > 0, top_k (0 = off), top_p: scalars.
    filtered: static; False skips the top-k / top-p sort (exact when top_k = 0, top_p = 1).
  Returns:
    float32 [G,M,R,V]: row [g,m,r] is the distribution token r of sample m was (or would
    be) drawn from given the prompt and tokens 0..r−1 (−inf outside the filtered set).
  """
  cfg = cfg.replace(moe_capacity_factor=0.0)  # the sampler's distribution: dropless experts
  h = grouped.response_hidden(cfg, params, prompt_tokens, prompt_lengths, response_tokens)
  logits = tx.logits_from_hidden(cfg, params, h)
  shape = logits.shape
  if filtered:
    z = sampling.filter_logits(logits.reshape(-1, shape[-1]), jnp.float32(temperature),
                               jnp.int32(top_k), jnp.float32(top_p))
  else:
    z = logits.reshape(-1, shape[-1]) / jnp.float32(temperature)
  return jax.nn.log_softmax(z, axis=-1).reshape(shape)


def accept_lengths(logp_new: np.ndarray, logp_old: np.ndarray, lengths: np.ndarray,
                   uniforms: np.ndarray, lenience: float = 0.0) -> np.ndarray:
  """Accepted prefix length of each draft: the index of the first rejected token.

  Token r is accepted iff ``u[r] < min(1, e^l · p(x_r)/q(x_r))``.

  Args:
    logp_new, logp_old: float [B,R] log p and log q of the draft tokens.
    lengths: int [B] draft lengths (positions >= length are ignored).
    uniforms: float [B,R] in [0, 1). lenience: l >= 0.
  Returns:
    int64 [B] in [0, length].
  """
  ratio = np.exp(np.minimum(lenience + np.asarray(logp_new, np.float64)
                            - np.asarray(logp_old, np.float64), 0.0))
  R = ratio.shape[1]
  ok = (uniforms < ratio) | (np.arange(R)[None, :] >= np.asarray(lengths)[:, None])
  first_bad = np.where(ok.all(axis=1), R, np.argmin(ok, axis=1))
  return np.minimum(first_bad, lengths).astype(np.int64)


def residual_token(logp_new: np.ndarray, logp_old: np.ndarray, u: float) -> int:
  """A token from ``norm(max(0, p − q))`` by inversion with uniform ``u`` (from p itself if
  the residual has no mass, which a rejection under l = 0 rules out up to round-off).

  Args:
    logp_new, logp_old: float [V] log p and log q. u: uniform in [0, 1).
  """
  p = np.exp(np.asarray(logp_new, np.float64))
  r = np.maximum(p - np.exp(np.asarray(logp_old, np.float64)), 0.0)
  w = r if r.sum() > 0 else p
  cdf = np.cumsum(w)
  tok = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
  tok = min(tok, len(w) - 1)
  while w[tok] <= 0:  # round-off at the top of the CDF: step back to a token with mass
    tok -= 1
  return tok


class Speculation(NamedTuple):
  """Prefixes to continue from, per row (B = G·M).

  tokens / logprobs: lists of B lists (accepted draft tokens, then the replacement token if
  one was rejected; log-probs under the current policy). finished: str or None per row
  ("eos" / "length" when the prefix is already a whole response). accepted: int [B] draft
  tokens kept.
  """

  tokens: list
  logprobs: list
  finished: list
  accepted: np.ndarray


def speculate(draft: np.ndarray, lengths: np.ndarray, logp_new: np.ndarray,
              logp_old: np.ndarray, rng: np.random.Generator, *, eos_ids: Sequence[int],
              max_new_tokens: int, lenience: float = 0.0) -> Speculation:
  """Verify drafts against the current policy: accepted prefix plus residual replacement.

  Args:
    draft: int [B,R] draft tokens; lengths: int [B] (0 = no draft: an empty prefix).
    logp_new, logp_old: float [B,R,V] full sampling log-probs of p (current) and q (the
      draft's policy) at each draft position.
    rng: source of the acceptance and residual uniforms.
    eos_ids: tokens that end a response. max_new_tokens: response budget.
    lenience: l (0 is exact).
  Returns:
    Speculation.
  """
  B, R = draft.shape
  rows = np.arange(B)[:, None]
  cols = np.arange(R)[None, :]
  lp_new = np.asarray(logp_new)[rows, cols, draft]
  lp_old = np.asarray(logp_old)[rows, cols, draft]
  u_acc = rng.random((B, R))
  u_res = rng.random(B)
  n = accept_lengths(lp_new, lp_old, lengths, u_acc, lenience)
  eos = set(int(e) for e in eos_ids)
  toks, lps, fin = [], [], []
  for b in range(B):
    k, L = int(n[b]), int(lengths[b])
    t = [int(x) for x in draft[b, :k]]
    lp = [float(x) for x in lp_new[b, :k]]
    done = None
    if L and k == L:  # the whole draft is accepted: it is a finished response
      done = "eos" if t[-1] in eos else "length"
    elif L:  # rejected at position k: draw the replacement from the residual
      y = residual_token(logp_new[b, k], logp_old[b, k], float(u_res[b]))
      t.append(y)
      lp.append(float(logp_new[b, k, y]))
      done = "eos" if y in eos else ("length" if len(t) >= max_new_tokens else None)
    toks.append(t)
    lps.append(lp)
    fin.append(done)
  return Speculation(toks, lps, fin, n)


def complete_prefixes(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]],
                      spec: Speculation, *, n: int, max_new_tokens: int, temperature: float,
                      top_p: float, top_k: int, eos_id, seed: int, first_index: int = 0,
                      policy_version: int = 0, mesh=None, rules=None,
                      prompt_pages: bool = False) -> Rollout:
  """Finish every row of ``spec`` with the rollout engine (prompt-once slots, resumed from
  prompt + prefix); as ``rollout.generate`` with the same ``seed`` and ``first_index``
  (row b = prompt b // n, sample b % n), so rows with an empty prefix sample exactly what
  ``generate`` samples. ``prompt_pages``: the prompt's ids after its first on pool pages
  (``RolloutEngine(prompt_pages=True)``): each row's prompt and accepted prefix is one run
  of ids, rebuilt by the group's longest and forked by the others where they agree.

  Returns:
    Rollout with G·n rows, prompt-major; prefix tokens are recorded with their current-policy
    log-probs and version ``policy_version``.
  """
  G = len(prompts)
  engine = RolloutEngine(cfg, n=n, max_slots=pow2(G), max_new_tokens=max_new_tokens,
                         max_prompt_len=max(len(p) for p in prompts), temperature=temperature,
                         top_p=top_p, top_k=top_k, eos_id=eos_id, seed=seed, mesh=mesh,
                         rules=rules, context=cfg.max_position_embeddings,
                         prompt_pages=prompt_pages)
  requests = []
  for g, p in enumerate(prompts):
    samples = []
    for m in range(n):
      b = g * n + m
      samples.append(Sample(list(spec.tokens[b]), list(spec.logprobs[b]),
                            [policy_version] * len(spec.tokens[b]), spec.finished[b]))
    requests.append(GroupRequest(first_index + g, [int(x) for x in p], samples))
  complete, _ = engine.run(engine.prepare_params(params), requests,
                           policy_version=policy_version)
  complete.sort(key=lambda r: r.uid)
  return assemble(complete, max_new_tokens)
