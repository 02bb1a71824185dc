"""Rollout engine: prompt-once groups, continuous batching, active partial rollouts (APRIL).

The single-turn face of the one rollout engine (``core.EngineCore``, run by ``loop.Loop``,
as the multi-turn engine is: a request's samples are one-turn records that end with their
first turn): this module turns requests into the loop's groups and back, and holds the
APRIL call and the held groups' checkpoint arrays (the held groups themselves, the
staleness bound and the uid counter are ``held.HeldGroups``, shared with the multi-turn
engine; records and argument checks are ``records``'s):

* Slots. A fixed number of group slots (``max_slots``), each holding one prompt's prefix
  K/V once and its ``n`` samples' own response K/V (``prompt_once=True``), or one sample per
  slot with its own copy of the prompt (``prompt_once=False``, the replicated baseline).
  With ``prompt_pages`` the slot's prompt cache holds the prompt's first id only and the
  rest lies on pool pages: written once for the group and taken by its other samples
  (whole pages shared by reference count, the partial last page copied), so the prompt's
  KV takes pages for its own length rather than ``max_prompt_len`` per slot.
* Continuous batching. The decode loop runs on device until a slot's group has finished and
  a request is waiting; the finished group is harvested, the waiting request is prefilled
  into the freed slot, and decoding continues. A long tail never idles the other slots.
* APRIL. ``rollout_groups`` asks for k_groups complete groups, keeps
  ``over_sampling·k_groups`` groups in flight, stops as soon as k_groups are complete, and pushes every unfinished group (with its
  tokens, per-token behaviour log-probs and per-token policy versions) into a FIFO buffer that
  is served first at the next call. A resumed sample is re-prefilled from prompt + partial
  response and continues with ``max_new_tokens − len(partial)`` tokens left. Only the
  still-running resumed samples are re-prefilled (the weights changed, so their old K/V is
  stale); finished samples and fresh groups are not.
* Staleness bound (AReaL's η, ``max_staleness``): at most ``(η+1)·k_groups`` groups in
  flight, and a held sample with a token more than η versions old is restarted, so no returned token lags
  the current policy by more than η versions. η = 0 is synchronous.
* Held groups. Between ``rollout_groups`` calls the engine holds complete groups beyond k_groups
  (``ready``) and aborted partial groups (``buffer``); ``export_held`` writes them as
  fixed-shape host arrays for a checkpoint and ``import_held`` rebuilds them, so a resumed
  run continues exactly.

Every token records the policy version that sampled it. Axis letters: the legend of
``rl_jax/__init__.py`` (G slots, M samples per slot, P prompt cache length,
R response cache length).

References: Zhou et al. 2025, "APRIL: Active Partial Rollouts in Reinforcement Learning to
Tame Long-tail Generation"; Yu et al. 2022, "Orca: A Distributed Serving System for
Transformer-Based Generative Models" (iteration-level scheduling); Fu et al. 2025, "AReaL"
(per-token policy versions, staleness-bounded admission).
"""

from __future__ import annotations

import collections
import itertools
from typing import Iterable, Iterator, Sequence

import numpy as np

from rl_jax.models.config import ModelConfig
from rl_jax.rollout import kv_cache, pages, sampler
from rl_jax.rollout.agent_records import Trajectory
from rl_jax.rollout.core import EngineCore
from rl_jax.rollout.held import lag_stats, rows
from rl_jax.rollout.kv_cache import REASON_NAMES
from rl_jax.rollout.loop import DONE, RUN, Group, Loop, warmup
from rl_jax.rollout.records import (REASON_CODES, GroupRequest, Prompt, Rollout, RolloutError,
                                    Sample, assemble, check_int, check_prompt)

__all__ = ["APRIL_STATS", "ENGINE_STATS", "FORK_STATS", "PAGE_STATS", "RolloutEngine",
           "kv_bytes"]

# The engine's counters in a rollout's ``stats``, one definition for every reader: the
# APRIL counters of ``rollout_groups`` (the multi-turn engine reports the same names) and
# the paged KV cache's (``RolloutEngine.page_stats``, also in ``generate``'s stats)
APRIL_STATS = ("off_policy_token_fraction", "max_token_lag", "aborted_groups",
               "restarted_samples", "buffer_size", "resumed_groups")
PAGE_STATS = ("kv_pages_used_mean", "kv_pages_used_peak", "preemptions", "prefix_pages_shared",
              "decode_buckets")
# samples forked at admission and the response positions they share (``slots.forks``); in
# ``generate``'s stats and a serving lane's loop, not the trainer's metrics (its samples
# share a response prefix only by chance)
FORK_STATS = ("forked_samples", "fork_tokens_shared")
ENGINE_STATS = APRIL_STATS + PAGE_STATS


# ------------------------------------------------------------------------------ engine
class RolloutEngine(EngineCore):
  """Slot-based sampler with prompt-once groups, continuous batching and APRIL.

  Usage::

      engine = RolloutEngine(cfg, n=8, max_slots=16, max_new_tokens=512, eos_id=tok.eos)
      out = engine.rollout_groups(params, prompt_iter, k_groups=32, policy_version=step)
      # out: Rollout with exactly 32·8 rows; unfinished groups wait in engine.buffer

  Args:
    cfg: model config. n: samples per prompt (M). max_slots: group slots decoded together.
    max_new_tokens: response budget per sample. max_prompt_len: longest prompt accepted
      (prefix cache length, rounded up to a power of two).
    temperature, top_p, top_k: sampling (temperature 0 is greedy).
    eos_id: int, list of ints, or None (no EOS). stop: list of token-id sequences that end a
      sample (included in the response and the mask).
    over_sampling: APRIL over-provisioning factor (>= 1; groups in flight = ceil(f·k_groups)).
    max_staleness: AReaL staleness bound η (None = unbounded). At most ``(η+1)·k_groups`` groups
      are in flight per call, and a resumed sample holding a token sampled more than η
      versions ago is restarted from its prompt, so every returned token has
      ``version >= policy_version − η``. η = 0 is synchronous (no partial rollouts).
    prompt_once: share each prompt's K/V across its n samples (False = replicated baseline).
    seed: base PRNG seed. mesh, rules: run under this mesh with these sharding rules.
    dtype: sampler compute/storage dtype; trainer parameters of another dtype are cast by a
      jitted cast at every call (None = keep cfg's dtypes).
    context: maximum positions (default cfg.max_position_embeddings).
    page_size: tokens per page of the response pool (a power of two; larger than the
      response cache length R means one page per sample, the worst-case slot layout).
    kv_pages: pool pages, fixed; when it runs out the most recently admitted group is
      preempted (its partial samples are kept and resumed by recompute, drawing the same
      tokens). None: the pool starts at enough pages for 256 tokens per sample and doubles
      when it runs out, up to every sample's whole budget (memory follows the tokens
      generated; never preempts).
    kv_memory_fraction: with kv_pages None, a fixed pool of this fraction of the free
      memory of the sampler's devices (``pages.pages_from_memory``; devices that report no
      capacity, e.g. CPU, keep the growing pool).
    prefill_chunk: prompts longer than this many tokens (a power of two) are prefilled in
      chunks of it (``prefill.prefill_prompts``: scores [chunk, P] per head at a time
      instead of [P, P]), and resumed samples re-prefilled in chunks of it
      (``slots.tail_rounds``); None: whole prompts and samples.
    share_prefixes: a resumed sample whose tokens begin those of another sample with its
      K/V (a resumed sample of its group; or, with the same prompt on the same pool shard,
      of another group admitted with it or decoding in a slot) is forked from it at
      admission (``slots.forks``: whole pages shared, the partial last page copied) instead
      of re-prefilled; False re-prefills every one (same tokens).
    prefix_cache: with ``share_prefixes``, the whole pages of samples that leave their slots
      stay in a cache of this many entries (least recently used dropped first, and whenever
      pages run short: before a growing pool grows, before a fixed pool preempts a group or
      turns one away) as sources for samples admitted later with the same prompt: a
      server's prompt pages across requests (``Loop.keep``). 0: none (the trainer's
      rollouts).
    prompt_pages: a prompt's ids after its first go onto pool pages, opening each sample as
      ids it did not sample (``Group.skip``): the admission's prefill writes them onto the
      group's first sample's pages and, with ``share_prefixes``, the others fork them
      (else each is re-prefilled). The samples draw the tokens they draw with the whole
      prompt in the slot's cache (their uniforms skip the prompt's ids:
      ``kv_cache.DecodeState.skip``), with log-probs equal to float rounding; the
      response cache holds ``max_prompt_len - 1 + max_new_tokens`` positions per sample.
  """

  def __init__(self, cfg: ModelConfig, *, n: int = 1, max_slots: int = 8,
               max_new_tokens: int = 128, max_prompt_len: int = 128, temperature: float = 1.0,
               top_p: float = 1.0, top_k: int = 0, eos_id=None, stop=None,
               over_sampling: float = 2.0, max_staleness: int | None = None,
               prompt_once: bool = True, seed: int = 0,
               mesh=None, rules=None, dtype: str | None = None, context: int | None = None,
               page_size: int = 64, kv_pages: int | None = None,
               kv_memory_fraction: float | None = None, prefill_chunk: int | None = 2048,
               share_prefixes: bool = True, prefix_cache: int = 0, prompt_pages: bool = False):
    check_int("max_new_tokens", max_new_tokens, 1)
    check_int("max_prompt_len", max_prompt_len, 1)
    self.prompt_pages = bool(prompt_pages)
    # with the prompt on pages the slot's cache holds its first id and the response cache
    # its other ids before the response
    budget = (("max_prompt_len - 1 + max_new_tokens", max_prompt_len - 1 + max_new_tokens)
              if self.prompt_pages else ("max_new_tokens", max_new_tokens))
    self._init_core(
        cfg, n=n, slots=max_slots, samples_per_slot=n if prompt_once else 1,
        max_prompt_len=1 if self.prompt_pages else max_prompt_len, budget=budget,
        temperature=temperature, top_p=top_p, top_k=top_k, eos_id=eos_id, stop=stop,
        over_sampling=over_sampling, max_staleness=max_staleness, mesh=mesh, rules=rules,
        dtype=dtype, context=context, page_size=page_size, kv_pages=kv_pages,
        kv_memory_fraction=kv_memory_fraction, prefill_chunk=prefill_chunk,
        share_prefixes=share_prefixes)
    self.max_new_tokens, self.prompt_once = int(max_new_tokens), bool(prompt_once)
    self.max_total = self.max_new_tokens  # after the whole prompt (``loop.total_tokens``)
    self.max_prompt_len = int(max_prompt_len)  # the longest prompt accepted
    check_int("prefix_cache", prefix_cache, 0)
    if prefix_cache and not share_prefixes:
      raise RolloutError("prefix_cache keeps pages for forks: it needs share_prefixes")
    self.prefix_cache = int(prefix_cache)
    if (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
        or not -2**63 <= seed < 2**63):
      raise RolloutError(f"seed must be an integer in [-2**63, 2**63), got {seed!r}")
    self.seed = int(seed)
    self.stats: collections.Counter = collections.Counter()  # page counters, per run() call

  # ---------------------------------------------------------------- requests
  def new_request(self, prompt: Sequence[int] | Prompt, index: int = 0) -> GroupRequest:
    """A fresh group for ``prompt`` (validated; a ``Prompt`` keeps its tag)."""
    meta = None
    if isinstance(prompt, Prompt):
      prompt, meta = prompt.tokens, prompt.meta
    ids = check_prompt(prompt, index, self.cfg, self.max_new_tokens, self.context)
    if len(ids) > self.max_prompt_len:
      raise RolloutError(f"prompt {index} has {len(ids)} tokens, more than max_prompt_len="
                         f"{self.max_prompt_len}")
    return GroupRequest(self.held.new_uid(), ids, [Sample() for _ in range(self.n)], meta=meta)

  # ---------------------------------------------------------------- continuous batching
  def run(self, params, requests: Sequence[GroupRequest], *, policy_version: int = 0,
          min_complete: int | None = None) -> tuple[list[GroupRequest], list[GroupRequest]]:
    """Decode ``requests`` through the slots with continuous batching (``loop.Loop``: each
    request is a group of one-turn samples, or one group per sample with
    ``prompt_once=False``).

    Args:
      params: sampler parameters (see ``prepare_params``).
      requests: groups to serve, in order (partial groups resume where they stopped).
      policy_version: recorded for every token sampled in this call.
      min_complete: stop once this many groups are complete (None = all).
    Returns:
      (complete groups in completion order, unfinished groups in submission order; their
      partial samples are kept, not-started groups are returned untouched).
    """
    groups = [grp for req in requests for grp in self.groups_of(req)]
    loop = Loop(self, params, policy_version)
    complete, unfinished = loop.run(groups, min_complete)
    for grp in groups:
      k = grp.skip  # the prompt's ids opening each trajectory (``prompt_pages``)
      for i, t in zip(grp.sample_ids, grp.trajs):
        grp.owner.samples[i] = Sample(t.tokens[k:], t.logprobs[k:], t.versions[k:], t.finish,
                                      None if t.routing is None else t.routing[k:])
    self.stats = collections.Counter(
        {k: loop.stats[k] for k in ("preemptions", "prefix_pages_shared", "pool_growths")
         + FORK_STATS})
    self.stats.update(pages.usage_counters(loop.used, self.programs,
                                           loop.state.refs.size))
    return complete, unfinished

  def groups_of(self, req: GroupRequest) -> list[Group]:
    """The loop's groups of ``req``: one of its n samples (prompt-once), or one per sample
    (replicated), each sample a one-turn record of its tokens so far. With the loop's
    online calls (``loop.Loop.submit``, ``step``, ``running_tokens``, ``abort``) a caller
    serves requests as they come: ``loop.submit(engine.groups_of(engine.new_request(p)))``.
    With ``prompt_pages`` each trajectory opens with the prompt's ids after the first
    (``Group.skip`` of them; ``run`` cuts them off again)."""
    units = [list(range(self.n))] if self.prompt_once else [[i] for i in range(self.n)]
    head = 1 if self.prompt_pages else len(req.prompt)
    rest = list(req.prompt[head:])
    k = len(rest)
    out = []
    for ids in units:
      trajs = []
      for i in ids:
        smp = req.samples[i]
        routing = smp.routing
        if k and routing is not None:  # no expert record for the prompt's ids
          routing = np.concatenate([np.full((k, *routing.shape[1:]), -1, routing.dtype),
                                    routing])
        t = Trajectory(None, [], rest + list(smp.tokens), [0.0] * k + list(smp.logprobs),
                       [-1] * k + list(smp.versions), [False] * k + [True] * len(smp.tokens),
                       [0] * (k + len(smp.tokens)), finish=smp.finish_reason, routing=routing)
        trajs.append(t)
      grp = Group(req.uid, req.prompt[:head], trajs, None, owner=req, sample_ids=ids)
      grp.meta, grp.skip = req.meta, k
      grp.status = [RUN if t.finish is None else DONE for t in trajs]
      grp.budget = [k + self.max_new_tokens] * len(ids)
      grp.max_turn = self.max_new_tokens  # a fresh sample's budget (a one-id prompt)
      out.append(grp)
    return out

  # ---------------------------------------------------------------- pages
  def page_stats(self) -> dict[str, float]:
    """The last ``run``'s page counters (``PAGE_STATS``): pages in use when decode calls
    returned (mean, peak), preemptions, prompt pages shared by a group's samples instead of
    held by each (at this page size), decode programs compiled (live bucket x pool size);
    and the fork counters (``FORK_STATS``)."""
    return {k: float(self.stats.get(k, 0)) for k in PAGE_STATS + FORK_STATS}

  def warmup(self, params) -> int:
    """Compile every shape this engine can meet, so no later call compiles
    (``loop.warmup``: admission, resume and fork buckets, the decode loop at the first
    live-page bucket; longer responses compile one program per further power-of-two bucket
    when they reach it).

    Returns:
      The number of jitted programs traced (0 if all were already compiled).
    """
    return warmup(self, self.prepare_params(params))

  # ---------------------------------------------------------------- APRIL
  def rollout_groups(self, params, prompts: Iterable[Sequence[int]], k_groups: int, *,
                     policy_version: int = 0) -> Rollout:
    """Return exactly ``k_groups`` complete groups (APRIL), buffering the unfinished rest.

    Serving order: groups completed in excess at the previous call, then the buffer of
    aborted groups (FIFO), then new prompts pulled from ``prompts`` until
    ``ceil(over_sampling·k_groups)`` groups are in flight. Decoding stops as soon as
    ``k_groups`` groups are complete; unfinished groups keep their partial samples and go
    back to the front of the buffer. Fewer than ``k_groups`` come back only if ``prompts``
    and the buffer run out.

    Args:
      params: trainer parameters (cast/placed for the sampler without recompiling).
      prompts: iterable of token-id lists; pass an iterator to keep its position across
        calls (a list is read from the start each call).
      k_groups: complete groups to return. policy_version: version of ``params``.
    Returns:
      Rollout with k_groups·n rows (group-major, completion order); ``stats`` holds
      ``aborted_groups``, ``resumed_groups``, ``off_policy_token_fraction``, ``buffer_size``,
      ``restarted_samples`` (staleness bound) and ``max_token_lag``.
    """
    check_int("k_groups", k_groups, 1)
    params = self.prepare_params(params)
    it: Iterator = iter(prompts)
    restarted = self.held.enforce_staleness(policy_version, self.max_staleness, _restart)
    index = itertools.count()

    def new():
      prompt = next(it, None)
      return None if prompt is None else self.new_request(prompt, next(index))

    result, submit, need = self.held.serve(k_groups, self.over_sampling, self.max_staleness, new)
    aborted = 0
    if submit:
      complete, unfinished = self.run(params, submit, policy_version=policy_version,
                                      min_complete=need)
      aborted = self.held.settle(result, complete, unfinished, need,
                                 started=lambda req: req.started)
    out = assemble(result, self.max_new_tokens)
    out.stats.update(aborted_groups=aborted, buffer_size=len(self.buffer),
                     restarted_samples=restarted,
                     resumed_groups=sum(1 for r in result if r.resumed),
                     **lag_stats(out.versions, out.mask, policy_version),
                     kv_bytes=kv_bytes(self, self.G), **self.page_stats())
    return out

  # ---------------------------------------------------------------- held groups
  def export_held(self, capacity: int) -> dict[str, np.ndarray]:
    """The held groups (complete extras, then the buffer) as fixed-shape host arrays.

    For checkpoints: ``import_held`` rebuilds the same engine state, so a resumed run
    continues exactly. Group tags must be integers (e.g. dataset indices).

    Args:
      capacity: rows of the arrays (>= number of held groups).
    Returns:
      dict: valid, ready bool [capacity]; uid, resumed, meta, prompt_len int32 [capacity];
      prompt int32 [capacity,P]; tokens, versions int32 [capacity,M,R]; logprobs float32
      [capacity,M,R]; length, reason int32 [capacity,M] (reason -1 = unfinished);
      next_uid int32 []; mixture-of-experts models also routing int32 [capacity,M,R,Y,X]
      (``Sample.routing``, -1 where none was recorded).
    """
    d, held = self.held.export(capacity, self.max_prompt_len)
    cap, n, R = capacity, self.n, self.max_new_tokens
    d.update(tokens=np.zeros((cap, n, R), np.int32), versions=np.full((cap, n, R), -1, np.int32),
             logprobs=np.zeros((cap, n, R), np.float32), length=np.zeros((cap, n), np.int32),
             reason=np.full((cap, n), -1, np.int32))
    if self.cfg.is_moe:
      d["routing"] = np.full((cap, n, R, len(self.cfg.moe_layers), self.cfg.num_experts_per_tok),
                             -1, np.int32)
    for h, req in enumerate(held):
      for i, smp in enumerate(req.samples):
        t = len(smp.tokens)
        d["tokens"][h, i, :t], d["versions"][h, i, :t] = smp.tokens, smp.versions
        d["logprobs"][h, i, :t], d["length"][h, i] = smp.logprobs, t
        if smp.finish_reason is not None:
          d["reason"][h, i] = REASON_CODES[smp.finish_reason]
        if "routing" in d and smp.routing is not None:
          d["routing"][h, i, :t] = smp.routing
    return d

  def import_held(self, d) -> None:
    """Replace the held groups and the uid counter with ``export_held``'s arrays."""
    d = {k: np.asarray(v) for k, v in d.items()}
    held = []
    for row in rows(d):
      h, samples = row.h, []
      for i in range(self.n):
        t = int(d["length"][h, i])
        code = int(d["reason"][h, i])
        samples.append(Sample(d["tokens"][h, i, :t].tolist(), d["logprobs"][h, i, :t].tolist(),
                              d["versions"][h, i, :t].tolist(),
                              None if code < 0 else REASON_NAMES[code],
                              d["routing"][h, i, :t].copy() if "routing" in d else None))
      held.append((GroupRequest(row.uid, row.prompt, samples, row.resumed, row.meta),
                   row.ready))
    self.held.replace(held, int(d["next_uid"]))


def _restart(req: GroupRequest, oldest: int) -> int:
  """Drop the samples of ``req`` holding a token of a version below ``oldest`` (they start
  over from the prompt); how many were dropped. The staleness bound's restart
  (``HeldGroups.enforce_staleness``)."""
  restarted = 0
  for i, smp in enumerate(req.samples):
    if smp.versions and min(smp.versions) < oldest:
      req.samples[i] = Sample()
      restarted += 1
  return restarted


def kv_bytes(engine: RolloutEngine, groups: int) -> int:
  """KV-cache bytes the engine holds for ``groups`` slots: their prompt caches and the
  response pool at its size after the last ``run``."""
  pool = engine.stats.get("kv_pages", engine.pool_pages)
  return (sampler.kv_cache_bytes(engine.cfg, groups, engine.M, engine.P, 0, True)
          + kv_cache.pool_bytes(engine.cfg, pool, engine.S))
