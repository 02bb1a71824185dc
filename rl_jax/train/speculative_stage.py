"""SPEC-RL in the trainer (``rollout.speculative=True``): the last responses of a prompt are
the drafts of its next visit.

``TrainState.spec_drafts`` keeps, per train prompt, its M most recent responses and the full
sampling distribution each token was drawn from (``rl_jax.rollout.speculative``): tokens
int32 [I,M,R], length int32 [I,M] (0 = no draft yet), logq float32 [I,M,R,V]. A step
verifies the drafts of its prompts with one teacher-forced pass of the current policy,
keeps the accepted prefixes (exact speculative sampling: the replacement token at a
rejection comes from the residual distribution), decodes only the rest, and stores the
final responses with the current policy's distributions as the next drafts. Memory of the
drafts: I·M·R·V·4 bytes (the full distributions are what makes the residual draw exact).

Shapes (package legend): G groups, M samples per prompt, P prompt bucket, R new tokens,
V vocab; I train prompts.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from rl_jax import config as config_lib
from rl_jax.errors import ConfigError
from rl_jax.rollout import speculative
from rl_jax.train.streams import Stream, seed_for

__all__ = ["MAX_DRAFT_BYTES", "draft_bytes", "check_draft_bytes", "drafts_state", "roll"]

MAX_DRAFT_BYTES = 4 << 30  # the drafts' distributions are train state: keep them bounded


def draft_bytes(geo: config_lib.Geometry, num_prompts: int, vocab: int) -> int:
  """Bytes of the drafts' arrays of ``num_prompts`` prompts: M samples of R tokens each with
  their float32 distributions over ``vocab`` (checked against ``MAX_DRAFT_BYTES`` by the
  setup)."""
  return num_prompts * geo.samples * geo.new_tokens * vocab * 4


def check_draft_bytes(speculative: bool, geo: config_lib.Geometry, num_prompts: int,
                      vocab: int) -> None:
  """The SPEC-RL rule (``rollout.speculative``): the drafts of ``num_prompts`` prompts fit
  ``MAX_DRAFT_BYTES`` (the setup checks it before anything is built)."""
  size = draft_bytes(geo, num_prompts, vocab)
  if speculative and size > MAX_DRAFT_BYTES:
    raise ConfigError(f"rollout.speculative=True would keep {size / 2**30:.1f} GiB of drafts "
                      f"({num_prompts} prompts x {geo.samples} samples x {geo.new_tokens} "
                      f"tokens x {vocab} vocab x 4 bytes; the limit is "
                      f"{MAX_DRAFT_BYTES / 2**30:.0f} GiB)")


def drafts_state(speculative: bool, geo: config_lib.Geometry, num_prompts: int,
                 vocab: int) -> dict:
  """The drafts of a fresh run (``ProducerState.drafts``): none yet (``{}`` when
  ``rollout.speculative`` is off). tokens int32 [N,M,R], length int32 [N,M], logq float32
  [N,M,R,V]."""
  if not speculative:
    return {}
  check_draft_bytes(speculative, geo, num_prompts, vocab)
  M, R = geo.samples, geo.new_tokens
  return {"tokens": np.zeros((num_prompts, M, R), np.int32),
          "length": np.zeros((num_prompts, M), np.int32),
          "logq": np.zeros((num_prompts, M, R, vocab), np.float32)}


def _padded(prompts, P: int, pad: int):
  out = np.full((len(prompts), P), pad, np.int32)
  for i, p in enumerate(prompts):
    out[i, :len(p)] = p
  return jnp.asarray(out), jnp.asarray([len(p) for p in prompts], jnp.int32)


def roll(s, params, drafts: dict, idx: np.ndarray, prompts: list, *, step: int,
         first_index: int, version: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
  """Sample M responses for each prompt of ``idx`` (dataset indices, [g]) speculatively, and
  write them into ``drafts`` (host arrays, updated in place) as the next drafts.

  Rows without a draft are sampled from scratch, with the key streams ``generate`` would use
  (``first_index``, ``Stream.ROLLOUT``); acceptance and residual draws use
  ``Stream.SPECULATIVE``.

  Returns:
    tokens int32 [g·M,R], mask bool [g·M,R], behaviour log-probs float32 [g·M,R] (the current
    policy's for every token), and the step's SPEC-RL counters.
  """
  r = s.rollout
  M, R = s.geometry.samples, s.geometry.new_tokens
  pt, pl = _padded(prompts, s.prompt_len, s.tokenizer.pad_id)
  dt = drafts["tokens"][idx]
  dl = drafts["length"][idx].reshape(-1)
  filtered = r.top_k > 0 or r.top_p < 1.0
  rows = lambda toks: np.asarray(speculative.sampling_logprobs(
      s.model_cfg, params, pt, pl, jnp.asarray(toks), r.temperature, r.top_k, r.top_p,
      filtered=filtered))
  # no drafts yet (a prompt's first visit): nothing to verify
  p_all = rows(dt) if dl.any() else np.zeros(dt.shape + (s.model_cfg.vocab_size,), np.float32)
  p_rows = p_all.reshape(len(idx) * M, R, -1)
  q_rows = drafts["logq"][idx].reshape(len(idx) * M, R, -1)
  rng = np.random.default_rng([seed_for(s.train.seed, step, Stream.SPECULATIVE), first_index])
  eos = s.eos_id if isinstance(s.eos_id, (list, tuple)) else [s.eos_id]
  sp = speculative.speculate(dt.reshape(len(idx) * M, R), dl, p_rows, q_rows, rng,
                             eos_ids=eos, max_new_tokens=R, lenience=r.spec_lenience)
  out = speculative.complete_prefixes(
      s.model_cfg, params, prompts, sp, n=M, max_new_tokens=R, temperature=r.temperature,
      top_p=r.top_p, top_k=r.top_k, eos_id=s.eos_id,
      seed=seed_for(s.train.seed, step, Stream.ROLLOUT), first_index=first_index,
      policy_version=version, mesh=s.sampler_mesh, rules=s.sampler_rules,
      prompt_pages=r.prompt_pages)
  tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
  drafts["tokens"][idx] = tokens.reshape(len(idx), M, R)
  drafts["length"][idx] = mask.sum(axis=1).reshape(len(idx), M)
  # the verify pass already holds the rows of every response that is its whole draft
  kept = (sp.accepted == dl) & (dl > 0)
  drafts["logq"][idx] = p_all if kept.all() else rows(tokens.reshape(len(idx), M, R))
  stats = {"spec_drafted_samples": float(np.sum(dl > 0)),
           "spec_reused_tokens": float(sp.accepted.sum())}  # counts: they add over calls
  return tokens, mask, np.asarray(out.logprobs), stats
