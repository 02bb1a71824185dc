"""One-shot sampling: ``generate`` serves a list of prompts through a fresh ``RolloutEngine``.

Axis letters: the legend of ``rl_jax/__init__.py`` (G prompts, M = n samples per
prompt, R = max_new_tokens).
"""

from __future__ import annotations

from typing import Sequence

from rl_jax.models.config import ModelConfig
from rl_jax.rollout import sampler
from rl_jax.rollout.engine import RolloutEngine, kv_bytes
from rl_jax.rollout.records import (GroupRequest, Rollout, RolloutError, Sample, as_ids,
                                    assemble, check_int, check_prompt, pow2)

__all__ = ["check_prefixes", "generate"]


def check_prefixes(prefixes, groups: int, cfg: ModelConfig, max_new_tokens: int):
  """``generate``'s ``prefixes`` as lists of ints (G empty ones for None); RolloutError on
  a wrong count, an id outside the vocabulary or a prefix leaving no room for a token."""
  if prefixes is None:
    return [[] for _ in range(groups)]
  if isinstance(prefixes, (str, bytes)) or not hasattr(prefixes, "__len__") or (
      len(prefixes) != groups):
    raise RolloutError(f"prefixes must be one token-id list per prompt ({groups})")
  out = []
  for i, p in enumerate(prefixes):
    if isinstance(p, (str, bytes)):
      raise RolloutError(f"prefix {i} must be a sequence of integer token ids")
    ids = as_ids(p, f"prefix {i}", cfg.vocab_size)
    if len(ids) >= max_new_tokens:
      raise RolloutError(f"prefix {i} has {len(ids)} tokens; max_new_tokens="
                         f"{max_new_tokens} leaves no room to continue it")
    out.append(ids)
  return out


def generate(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], n: int = 1,
             max_new_tokens: int = 128, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int = 0, eos_id=None, seed: int = 0, *, stop=None,
             prompt_once: bool = True, max_slots: int | None = None, mesh=None, rules=None,
             policy_version: int = 0, first_index: int = 0, page_size: int = 64,
             kv_pages: int | None = None, kv_memory_fraction: float | None = None,
             prefill_chunk: int | None = 2048, prefixes: Sequence[Sequence[int]] | None = None,
             share_prefixes: bool = True, prompt_pages: bool = False) -> Rollout:
  """Sample ``n`` responses for every prompt with the jitted KV-cache sampler.

  Args:
    cfg, params: the model (params are a jit argument; new weights never recompile).
    prompts: list of G token-id lists (different lengths allowed).
    n: samples per prompt. max_new_tokens: response budget R.
    temperature: 0 is greedy. top_p in (0,1], top_k >= 0 (0 = off).
    eos_id: int, list of ints or None (no EOS). seed: PRNG seed; sample i of prompt p uses
      its own key stream, so results do not depend on batching, slots or mesh.
    stop: list of token-id stop sequences. prompt_once: share each prompt's K/V across its
      n samples (False = replicate the prompt per sample; same tokens).
    max_slots: groups decoded together (default: the number of groups, rounded up to a
      power of two; fewer uses continuous batching).
    mesh, rules: run sharded (batch over data/fsdp, heads over tensor, cache over sequence).
    first_index: index of ``prompts[0]`` in a larger batch: prompt p samples from the key
      stream of prompt ``first_index + p``, so a batch split over processes (each calling
      with its own slice) samples exactly what one call over the whole batch samples.
    page_size, kv_pages, kv_memory_fraction: the paged response cache (``RolloutEngine``):
      tokens per page, a fixed pool size in pages, or the fraction of free device memory a
      fixed pool takes (both None: grown as the responses need it).
    prefill_chunk: prompts longer than this many tokens are prefilled in chunks of it, and
      preempted samples re-prefilled in chunks of it (bounded memory for long prompts and
      responses); None: whole.
    prefixes: one list of response tokens per prompt that its n samples continue from (a
      mid-sequence state: tree rollouts, re-rollouts from a point of an earlier response);
      they open each row with log-prob 0 and version -1 (not sampled here) and count
      against ``max_new_tokens``. The prefix is prefilled once per prompt and the other
      samples fork it (``share_prefixes``: whole pages shared, the partial last page
      copied; False prefills it for every sample, for comparison).
    prompt_pages: each prompt's ids after its first on pool pages, written once per prompt
      and forked by its other samples (``RolloutEngine(prompt_pages=True)``): the same
      tokens, log-probs equal to float rounding, prompt KV for the prompts' own lengths.
  Returns:
    Rollout with G·M rows (M = n), prompt-major: tokens int32 [G·M,R] (R = max_new_tokens),
    mask, logprobs, versions, lengths, finish_reason ("eos" / "stop" / "length"),
    stats["kv_bytes"] (prompt caches and response pool held), stats["kv_bytes_replicated"]
    (every sample's prompt and whole budget, the replicated worst case) and the page
    counters ``engine.PAGE_STATS`` and ``engine.FORK_STATS``.
  """
  if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
    raise RolloutError("prompts must be a list of token-id lists")
  if len(prompts) == 0:
    raise RolloutError("prompts is empty; pass at least one prompt")
  check_int("n", n, 1)
  check_int("max_new_tokens", max_new_tokens, 1)
  context = cfg.max_position_embeddings
  checked = [check_prompt(p, i, cfg, max_new_tokens, context) for i, p in enumerate(prompts)]
  longest = max(len(p) for p in checked)
  groups = len(checked) if prompt_once else len(checked) * n
  slots = pow2(groups) if max_slots is None else max_slots
  engine = RolloutEngine(cfg, n=n, max_slots=slots, max_new_tokens=max_new_tokens,
                         max_prompt_len=longest, temperature=temperature, top_p=top_p,
                         top_k=top_k, eos_id=eos_id, stop=stop, prompt_once=prompt_once,
                         seed=seed, mesh=mesh, rules=rules, context=context,
                         page_size=page_size, kv_pages=kv_pages,
                         kv_memory_fraction=kv_memory_fraction, prefill_chunk=prefill_chunk,
                         share_prefixes=share_prefixes, prompt_pages=prompt_pages)
  check_int("first_index", first_index, 0)
  heads = check_prefixes(prefixes, len(checked), cfg, max_new_tokens)
  fresh = lambda i: Sample(list(heads[i]), [0.0] * len(heads[i]), [-1] * len(heads[i]))
  requests = [GroupRequest(first_index + i, p, [fresh(i) for _ in range(n)])
              for i, p in enumerate(checked)]
  complete, _ = engine.run(engine.prepare_params(params), requests,
                           policy_version=policy_version)
  complete.sort(key=lambda r: r.uid)
  out = assemble(complete, max_new_tokens)
  P, R = pow2(longest, 8), pow2(max_new_tokens, 8)  # the slot layout's caches
  out.stats.update(
      kv_bytes=kv_bytes(engine, min(slots, groups)),
      kv_bytes_replicated=sampler.kv_cache_bytes(engine.cfg, len(checked), n, P, R, False),
      **engine.page_stats())
  return out
