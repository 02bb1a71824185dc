"""Rollout engine: prompt-once groups, continuous batching, active partial rollouts (APRIL).

The engine drives the jitted pieces in ``rl_jax.rollout.sampler`` from Python:

* Slots. A fixed number of group slots (``max_slots``), each holding one prompt's prefix
  K/V once and its ``n`` samples' own response K/V (``prompt_once=True``), or one sample per
  slot with its own copy of the prompt (``prompt_once=False``, the replicated baseline).
* Continuous batching. The decode loop runs on device until a slot's group has finished and
  a request is waiting; the finished group is harvested, the waiting request is prefilled
  into the freed slot, and decoding continues. A long tail never idles the other slots.
* APRIL. ``rollout_groups`` asks for K complete groups, keeps ``over_sampling·K`` groups in
  flight, stops as soon as K are complete, and pushes every unfinished group (with its
  tokens, per-token behaviour log-probs and per-token policy versions) into a FIFO buffer that
  is served first at the next call. A resumed sample is re-prefilled from prompt + partial
  response and continues with ``max_new_tokens − len(partial)`` tokens left. Only the
  still-running resumed samples are re-prefilled (the weights changed, so their old K/V is
  stale); finished samples and fresh groups are not.
* Staleness bound (AReaL's η, ``max_staleness``): at most ``(η+1)·K`` groups in flight, and a
  held sample with a token more than η versions old is restarted, so no returned token lags
  the current policy by more than η versions. η = 0 is synchronous.

Every token records the policy version that sampled it.

References: Zhou et al. 2025, "APRIL: Active Partial Rollouts in Reinforcement Learning to
Tame Long-tail Generation"; Yu et al. 2022, "Orca: A Distributed Serving System for
Transformer-Based Generative Models" (iteration-level scheduling); Fu et al. 2025, "AReaL"
(per-token policy versions, staleness-bounded admission).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from typing import Any, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import models, sharding
from rl_jax.errors import RLJaxError
from rl_jax.models.config import ModelConfig
from rl_jax.rollout import sampler, sampling


class RolloutError(RLJaxError, ValueError):
  """A rollout argument is invalid (prompt, budget, sampling setting, stop token ...)."""


# ------------------------------------------------------------------------------ records
@dataclasses.dataclass
class Sample:
  """One trajectory (possibly partial). Lists are aligned token by token."""

  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None  # None while unfinished


@dataclasses.dataclass
class Prompt:
  """A prompt with a caller's tag (e.g. its dataset index), returned with its group."""

  tokens: Sequence[int]
  meta: Any = None


@dataclasses.dataclass
class GroupRequest:
  """A prompt and its n samples; ``uid`` identifies its PRNG streams."""

  uid: int
  prompt: list[int]
  samples: list[Sample]
  resumed: int = 0  # how many times this group was aborted and resumed
  meta: Any = None  # the caller's tag (``Prompt.meta``)

  @property
  def done(self) -> bool:
    return all(s.finish_reason is not None for s in self.samples)

  @property
  def started(self) -> bool:
    return any(s.tokens for s in self.samples)


@dataclasses.dataclass
class Rollout:
  """Sampled responses, one row per sample, prompt-major (prompt 0's n samples first).

  Attributes (B = groups·n rows, R = max_new_tokens):
    tokens: int32 [B,R] (0 after the end). mask: bool [B,R], True for generated tokens up to
      and including EOS / the stop sequence.
    logprobs: float32 [B,R] log-prob of each token under the distribution it was sampled
      from (after temperature/top-k/top-p; 0 for greedy and padding).
    versions: int32 [B,R] policy version that sampled each token (-1 on padding).
    lengths: int32 [B]. finish_reason: str [B], one of "eos", "stop", "length".
    prompt_index: int32 [B] the row's prompt (index into ``prompts``).
    prompts: list of the G prompts (token-id lists). group_ids: int [G] request uids.
    stats: dict of scalars (tokens, kv bytes, aborted groups, off-policy token fraction ...).
    group_meta: the caller's tag of each group (``Prompt.meta``; None for plain prompts).
  """

  tokens: np.ndarray
  mask: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  lengths: np.ndarray
  finish_reason: np.ndarray
  prompt_index: np.ndarray
  prompts: list[list[int]]
  group_ids: np.ndarray
  stats: dict[str, float]
  group_meta: list = dataclasses.field(default_factory=list)


def _pow2(x: int, lo: int = 1) -> int:
  return max(lo, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


def _as_ids(values, what: str, vocab: int) -> list[int]:
  try:
    ids = [int(t) for t in values]
  except (TypeError, ValueError):
    raise RolloutError(f"{what} must be a sequence of integer token ids") from None
  bad = [t for t in ids if not 0 <= t < vocab]
  if bad:
    raise RolloutError(f"{what} has token id {bad[0]} outside the vocabulary [0, {vocab})")
  return ids


def check_prompt(prompt, index: int, cfg: ModelConfig, max_new_tokens: int,
                 context: int) -> list[int]:
  """Validated token-id list; raises RolloutError naming the prompt."""
  if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
    raise RolloutError(f"prompt {index} must be a list of token ids, got {type(prompt).__name__}")
  ids = _as_ids(prompt, f"prompt {index}", cfg.vocab_size)
  if not ids:
    raise RolloutError(f"prompt {index} is empty; every prompt needs at least one token")
  if len(ids) + max_new_tokens > context:
    raise RolloutError(f"prompt {index} has {len(ids)} tokens; with max_new_tokens="
                       f"{max_new_tokens} it exceeds the context of {context} positions")
  return ids


# ------------------------------------------------------------------------------ engine
class RolloutEngine:
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
    over_sampling: APRIL over-provisioning factor (>= 1; groups in flight = ceil(f·K)).
    max_staleness: AReaL staleness bound η (None = unbounded). At most ``(η+1)·K`` groups
      are in flight per call, and a resumed sample holding a token sampled more than η
      versions ago is restarted from its prompt, so every returned token has
      ``version >= policy_version − η``. η = 0 is synchronous (no partial rollouts).
    prompt_once: share each prompt's K/V across its n samples (False = replicated baseline).
    seed: base PRNG seed. mesh, rules: run under this mesh with these sharding rules.
    dtype: sampler compute/storage dtype; trainer parameters of another dtype are cast by a
      jitted cast at every call (None = keep cfg's dtypes).
    context: maximum positions (default cfg.max_position_embeddings).
  """

  def __init__(self, cfg: ModelConfig, *, n: int = 1, max_slots: int = 8,
               max_new_tokens: int = 128, max_prompt_len: int = 128, temperature: float = 1.0,
               top_p: float = 1.0, top_k: int = 0, eos_id=None, stop=None,
               over_sampling: float = 2.0, max_staleness: int | None = None,
               prompt_once: bool = True, seed: int = 0,
               mesh=None, rules=None, dtype: str | None = None, context: int | None = None):
    self.context = int(context or cfg.max_position_embeddings)
    _check_int("n", n, 1)
    _check_int("max_slots", max_slots, 1)
    _check_int("max_new_tokens", max_new_tokens, 1)
    _check_int("max_prompt_len", max_prompt_len, 1)
    if not isinstance(top_k, (int, np.integer)) or top_k < 0:
      raise RolloutError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
    if not 0.0 < float(top_p) <= 1.0:
      raise RolloutError(f"top_p must lie in (0, 1], got {top_p!r}")
    if not float(temperature) >= 0.0:
      raise RolloutError(f"temperature must be >= 0 (0 is greedy), got {temperature!r}")
    if not float(over_sampling) >= 1.0:
      raise RolloutError(f"over_sampling must be >= 1, got {over_sampling!r}")
    if max_staleness is not None:
      _check_int("max_staleness", max_staleness, 0)
    if max_prompt_len + max_new_tokens > self.context:
      raise RolloutError(f"max_prompt_len={max_prompt_len} + max_new_tokens={max_new_tokens} "
                         f"exceeds the context of {self.context} positions")
    if (mesh is None) != (rules is None):
      raise RolloutError("pass both mesh and rules, or neither")
    if dtype is not None:
      cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    self.cfg, self.n, self.max_new_tokens = cfg, int(n), int(max_new_tokens)
    self.max_prompt_len, self.prompt_once = int(max_prompt_len), bool(prompt_once)
    self.over_sampling, self.seed = float(over_sampling), int(seed)
    self.max_staleness = None if max_staleness is None else int(max_staleness)
    self.M = self.n if prompt_once else 1
    self.G = int(max_slots)
    self.P = _pow2(self.max_prompt_len, 8)
    self.R = _pow2(self.max_new_tokens, 8)
    self.ctx = None if mesh is None else (mesh, sharding.get_rules(rules))
    self.sp, self.filtered = _sampling_params(cfg, temperature, top_k, top_p, eos_id, stop)
    self.buffer: collections.deque[GroupRequest] = collections.deque()
    self._ready: collections.deque[GroupRequest] = collections.deque()
    self._uids = itertools.count()
    self._target = self._sync = None  # sampler parameter layout, jitted cast + reshard

  @property
  def ready(self) -> tuple[GroupRequest, ...]:
    """Complete groups beyond K from the previous call; returned first at the next call."""
    return tuple(self._ready)

  # ---------------------------------------------------------------- parameters
  def prepare_params(self, params):
    """Trainer parameters -> sampler parameters, on device.

    With a mesh: one jitted program casts to the sampler dtype and reshards to the sampler's
    layout (``out_shardings``), so XLA moves shards device to device (collectives), never
    through host memory; compiled once per input layout. A no-op when the parameters are
    already in the sampler's dtype and layout. Parameters on devices outside the sampler's
    mesh (disaggregated trainer / sampler) are copied over with ``jax.device_put`` first.
    """
    want = jnp.dtype(self.cfg.param_dtype)
    leaves = jax.tree.leaves(params)
    if self.ctx is None:
      if any(leaf.dtype != want for leaf in leaves):
        params = sampler.cast_params(params, str(want))
      return params
    mesh, rules = self.ctx
    if self._target is None:
      self._target = models.param_shardings(self.cfg, mesh, rules)
      self._sync = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(want), p),
                           out_shardings=self._target)
    targets = jax.tree.leaves(self._target)
    if all(leaf.dtype == want and isinstance(leaf, jax.Array)
           and leaf.sharding.is_equivalent_to(t, leaf.ndim) for leaf, t in zip(leaves, targets)):
      return params
    devices = set(mesh.devices.flat)
    if not all(isinstance(leaf, jax.Array) and leaf.sharding.device_set <= devices
               for leaf in leaves):
      params = jax.device_put(params, self._target)
    return self._sync(params)

  def new_request(self, prompt: Sequence[int] | Prompt, index: int = 0) -> GroupRequest:
    """A fresh group for ``prompt`` (validated; a ``Prompt`` keeps its tag)."""
    meta = None
    if isinstance(prompt, Prompt):
      prompt, meta = prompt.tokens, prompt.meta
    ids = check_prompt(prompt, index, self.cfg, self.max_new_tokens, self.context)
    if len(ids) > self.max_prompt_len:
      raise RolloutError(f"prompt {index} has {len(ids)} tokens, more than max_prompt_len="
                         f"{self.max_prompt_len}")
    return GroupRequest(next(self._uids), ids, [Sample() for _ in range(self.n)], meta=meta)

  # ---------------------------------------------------------------- continuous batching
  def run(self, params, requests: Sequence[GroupRequest], *, policy_version: int = 0,
          min_complete: int | None = None) -> tuple[list[GroupRequest], list[GroupRequest]]:
    """Decode ``requests`` through the slots with continuous batching.

    Args:
      params: sampler parameters (see ``prepare_params``).
      requests: groups to serve, in order (partial groups resume where they stopped).
      policy_version: recorded for every token sampled in this call.
      min_complete: stop once this many groups are complete (None = all).
    Returns:
      (complete groups in completion order, unfinished groups in submission order; their
      partial samples are kept, not-started groups are returned untouched).
    """
    cfg, G, M = self.cfg, self.G, self.M
    want = len(requests) if min_complete is None else min(min_complete, len(requests))
    units = collections.deque()  # (request, sample ids) in submission order
    for req in requests:
      todo = [i for i, s in enumerate(req.samples) if s.finish_reason is None]
      if not todo:
        continue
      if self.prompt_once:
        units.append((req, list(range(self.n))))
      else:
        units.extend((req, [i]) for i in todo)
    complete = [r for r in requests if r.done]
    slot_unit: list[Any] = [None] * G
    state = sampler.init_state(cfg, G, M, self.P, self.R, ctx=self.ctx)
    key = jax.random.key(self.seed, impl="threefry2x32")
    version = jnp.int32(policy_version)
    remaining = collections.Counter(id(u[0]) for u in units)
    while len(complete) < want:
      free = [g for g in range(G) if slot_unit[g] is None]
      batch = [(g, units.popleft()) for g in free[:len(units)]]
      if batch:
        for g, unit in batch:
          slot_unit[g] = unit
        fresh = len(free) == G  # first admission of this call: no scatter into old slots
        state = self._admit(params, state, batch, version, key, fresh)
      state, done_slots = self._harvest(state, slot_unit, remaining, complete)
      if len(complete) >= want:
        break
      if all(u is None for u in slot_unit):
        if not units:
          break
        continue
      if done_slots:
        continue
      need = 1 if units else max(1, want - len(complete))
      state, _ = sampler.decode(cfg, params, state, self.sp, version, jnp.int32(self.R),
                                jnp.int32(need), filtered=self.filtered, ctx=self.ctx)
    # abort whatever is still in a slot: keep its partial samples
    if any(u is not None for u in slot_unit):
      self._collect(state, [g for g in range(G) if slot_unit[g] is not None], slot_unit)
    done_ids = {id(r) for r in complete}
    unfinished = [r for r in requests if id(r) not in done_ids]
    return complete, unfinished

  def _admit(self, params, state, batch, version, key, fresh=False):
    """Prefill the (slot, unit) pairs of ``batch`` into their slots."""
    Bn = min(self.G, _pow2(len(batch), 4))  # coarse buckets: few admission compiles
    Pb = min(self.P, _pow2(max(len(u[0].prompt) for _, u in batch), 8))
    a, resume = self._admission(batch, Bn, Pb)
    state = sampler.admit(self.cfg, params, state, sampler.Admission(**a), self.sp, version,
                          key, filtered=self.filtered, fresh=fresh and Bn == self.G,
                          ctx=self.ctx)
    if resume:
      Br, S = self._resume_shape(len(resume), max(r[3] for r in resume))
      res = self._resume_rows(Br, S)
      for r, (b, m, g, _) in enumerate(resume):
        res.slot[r], res.sample[r], res.length[r] = g, m, a["length"][b, m]
        res.tokens[r] = a["tokens"][b, m, :S]
      state = sampler.resume(self.cfg, params, state, res, ctx=self.ctx)
    return state

  def _resume_rows(self, Br: int, S: int) -> sampler.Resume:
    """An all-padding Resume of shape (Br, S)."""
    return sampler.Resume(np.full(Br, self.G, np.int32), np.zeros(Br, np.int32),
                          np.zeros((Br, S), np.int32), np.ones(Br, np.int32))

  def _admission(self, batch, Bn: int, Pb: int):
    """Host arrays of an Admission of shape (Bn, Pb) for ``batch`` (the rest padding), and
    the (row, sample, slot, tokens to prefill) of every resumed running sample."""
    M, R = self.M, self.R
    a = dict(slots=np.full(Bn, self.G, np.int32), prompt=np.zeros((Bn, Pb), np.int32),
             prompt_len=np.ones(Bn, np.int32), tokens=np.zeros((Bn, M, R), np.int32),
             logprobs=np.zeros((Bn, M, R), np.float32), versions=np.full((Bn, M, R), -1, np.int32),
             length=np.zeros((Bn, M), np.int32), reason=np.zeros((Bn, M), np.int32),
             budget=np.full((Bn, M), self.max_new_tokens, np.int32),
             request_id=np.zeros(Bn, np.int32), sample_id=np.zeros((Bn, M), np.int32))
    resume = []  # (row, sample, slot, tokens to prefill) of resumed running samples
    for b, (g, (req, sids)) in enumerate(batch):
      a["slots"][b] = g
      a["prompt"][b, :len(req.prompt)] = req.prompt
      a["prompt_len"][b] = len(req.prompt)
      a["request_id"][b] = req.uid
      for m, i in enumerate(sids):
        s = req.samples[i]
        t = len(s.tokens)
        a["sample_id"][b, m] = i
        a["tokens"][b, m, :t] = s.tokens
        a["logprobs"][b, m, :t] = s.logprobs
        a["versions"][b, m, :t] = s.versions
        a["length"][b, m] = t
        if s.finish_reason is not None:
          a["reason"][b, m] = _REASON_CODES[s.finish_reason]
        elif t > 1:
          resume.append((b, m, g, t - 1))
    return a, resume

  def warmup(self, params) -> int:
    """Compile every shape this engine can meet, so no later call compiles.

    Admission buckets (groups x prompt length, and the all-slots-free variant), resume
    buckets (samples x response length) and the decode loop, run once on padding rows.

    Returns:
      The number of jitted programs traced (0 if all were already compiled).
    """
    before = sum(sampler.TRACE_COUNTS.values())
    params = self.prepare_params(params)
    key, version = jax.random.key(self.seed, impl="threefry2x32"), jnp.int32(0)
    state = sampler.init_state(self.cfg, self.G, self.M, self.P, self.R, ctx=self.ctx)
    ladder = lambda lo, top: sorted({min(top, lo << i) for i in range(max(1, top).bit_length() + 1)})
    for Bn in ladder(4, self.G):
      for Pb in ladder(8, self.P):
        for fresh in ((False, True) if Bn == self.G else (False,)):
          a, _ = self._admission([], Bn, Pb)
          state = sampler.admit(self.cfg, params, state, sampler.Admission(**a), self.sp,
                                version, key, filtered=self.filtered, fresh=fresh,
                                ctx=self.ctx)
    rows = [4 ** i for i in range(1, (self.G * self.M).bit_length()) if 4 ** i < self.G * self.M]
    lengths = [self.R >> j for j in range(3) if self.R >> j >= 1]
    shapes = {self._resume_shape(r, n) for r in [1, *rows, self.G * self.M] for n in lengths}
    for Br, S in sorted(shapes):
      state = sampler.resume(self.cfg, params, state, self._resume_rows(Br, S), ctx=self.ctx)
    state, _ = sampler.decode(self.cfg, params, state, self.sp, version, jnp.int32(1),
                              jnp.int32(1), filtered=self.filtered, ctx=self.ctx)
    jax.block_until_ready(state)
    return sum(sampler.TRACE_COUNTS.values()) - before

  def _resume_shape(self, rows: int, longest: int) -> tuple[int, int]:
    """(Br, S) bucket for re-prefilling ``rows`` samples of up to ``longest`` tokens.

    Br steps by 4x from 4 up to all G·M samples; S is R/4, R/2 or R (3 lengths).
    """
    Br = 4
    while Br < rows:
      Br *= 4
    S = max(1, self.R // 4)
    while S < longest:
      S *= 2
    return min(Br, self.G * self.M), min(S, self.R)

  def _harvest(self, state, slot_unit, remaining, complete):
    """Move groups whose samples all finished out of their slots."""
    reason = np.asarray(state.reason)
    done = [g for g, u in enumerate(slot_unit)
            if u is not None and (reason[g, :len(u[1])] != sampler.RUNNING).all()]
    if not done:
      return state, []
    self._collect(state, done, slot_unit, remaining, complete)
    active = np.zeros(self.G, bool)
    active[[g for g, u in enumerate(slot_unit) if u is not None]] = True
    state = state._replace(active=jax.device_put(active, state.active.sharding))
    return state, done

  def _collect(self, state, slots, slot_unit, remaining=None, complete=None):
    """Copy the samples of ``slots`` back into their requests and free the slots."""
    host = jax.device_get((state.tokens, state.logprobs, state.versions, state.length,
                           state.reason))
    tokens, logprobs, versions, length, reason = host
    for g in slots:
      req, sids = slot_unit[g]
      for m, i in enumerate(sids):
        t = int(length[g, m])
        req.samples[i] = Sample(tokens[g, m, :t].tolist(), logprobs[g, m, :t].tolist(),
                                versions[g, m, :t].tolist(),
                                sampler.REASON_NAMES[int(reason[g, m])]
                                if reason[g, m] != sampler.RUNNING else None)
      slot_unit[g] = None
      if remaining is not None:
        remaining[id(req)] -= 1
        if remaining[id(req)] == 0 and req.done:
          complete.append(req)

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
      k_groups: K, complete groups to return. policy_version: version of ``params``.
    Returns:
      Rollout with K·n rows (group-major, completion order); ``stats`` holds
      ``aborted_groups``, ``resumed_groups``, ``off_policy_token_fraction``, ``buffer_size``,
      ``restarted_samples`` (staleness bound) and ``max_token_lag``.
    """
    _check_int("k_groups", k_groups, 1)
    params = self.prepare_params(params)
    it: Iterator = iter(prompts)
    restarted = self._enforce_staleness(policy_version)
    result: list[GroupRequest] = []
    while self._ready and len(result) < k_groups:
      result.append(self._ready.popleft())
    need = k_groups - len(result)
    in_flight = math.ceil(self.over_sampling * k_groups)
    if self.max_staleness is not None:
      # AReaL capacity (η + v + 1)·K − (accepted + running) with K groups accepted per
      # version: (η + 1)·K − running.
      in_flight = min(in_flight, (self.max_staleness + 1) * k_groups)
    in_flight = in_flight - len(result) if need > 0 else 0
    submit: list[GroupRequest] = []
    while self.buffer and len(submit) < in_flight:
      submit.append(self.buffer.popleft())
    index = 0
    while len(submit) < in_flight:
      prompt = next(it, None)
      if prompt is None:
        break
      submit.append(self.new_request(prompt, index))
      index += 1
    aborted = 0
    if submit:
      complete, unfinished = self.run(params, submit, policy_version=policy_version,
                                      min_complete=need)
      result.extend(complete[:need])
      self._ready.extend(complete[need:])
      for req in unfinished:
        if req.started:
          req.resumed += 1
          aborted += 1
      self.buffer.extendleft(reversed(unfinished))
    out = assemble(result, self.max_new_tokens)
    toks = out.mask.sum()
    stale = (out.versions < policy_version) & out.mask
    lag = np.where(out.mask, policy_version - out.versions, 0)
    out.stats.update(aborted_groups=aborted, buffer_size=len(self.buffer),
                     restarted_samples=restarted, max_token_lag=int(lag.max(initial=0)),
                     resumed_groups=sum(1 for r in result if r.resumed),
                     off_policy_token_fraction=float(stale.sum() / max(toks, 1)),
                     kv_bytes=kv_bytes(self, self.G))
    return out


  def export_held(self, capacity: int) -> dict[str, np.ndarray]:
    """The held groups (complete extras, then the buffer) as fixed-shape host arrays.

    For checkpoints: ``import_held`` rebuilds the same engine state, so a resumed run
    continues exactly. Group tags must be integers (e.g. dataset indices).

    Args:
      capacity: H, rows of the arrays (>= number of held groups).
    Returns:
      dict: valid, ready bool [H]; uid, resumed, meta, prompt_len int32 [H];
      prompt int32 [H,P]; tokens, versions int32 [H,n,R]; logprobs float32 [H,n,R];
      length, reason int32 [H,n] (reason -1 = unfinished); next_uid int32 [].
    """
    held = [(r, True) for r in self._ready] + [(r, False) for r in self.buffer]
    if len(held) > capacity:
      raise RolloutError(f"{len(held)} held groups do not fit capacity {capacity}")
    H, n, R = capacity, self.n, self.max_new_tokens
    d = dict(valid=np.zeros(H, bool), ready=np.zeros(H, bool), uid=np.zeros(H, np.int32),
             resumed=np.zeros(H, np.int32), meta=np.zeros(H, np.int32),
             prompt_len=np.zeros(H, np.int32), prompt=np.zeros((H, self.max_prompt_len), np.int32),
             tokens=np.zeros((H, n, R), np.int32), versions=np.full((H, n, R), -1, np.int32),
             logprobs=np.zeros((H, n, R), np.float32), length=np.zeros((H, n), np.int32),
             reason=np.full((H, n), -1, np.int32))
    for h, (req, ready) in enumerate(held):
      d["valid"][h], d["ready"][h], d["uid"][h], d["resumed"][h] = True, ready, req.uid, req.resumed
      d["meta"][h] = -1 if req.meta is None else int(req.meta)
      d["prompt_len"][h] = len(req.prompt)
      d["prompt"][h, :len(req.prompt)] = req.prompt
      for i, smp in enumerate(req.samples):
        t = len(smp.tokens)
        d["tokens"][h, i, :t], d["versions"][h, i, :t] = smp.tokens, smp.versions
        d["logprobs"][h, i, :t], d["length"][h, i] = smp.logprobs, t
        if smp.finish_reason is not None:
          d["reason"][h, i] = _REASON_CODES[smp.finish_reason]
    d["next_uid"] = np.int32(self._next_uid())
    return d

  def import_held(self, d) -> None:
    """Replace the held groups and the uid counter with ``export_held``'s arrays."""
    d = {k: np.asarray(v) for k, v in d.items()}
    self._ready.clear()
    self.buffer.clear()
    for h in np.flatnonzero(d["valid"]):
      samples = []
      for i in range(self.n):
        t = int(d["length"][h, i])
        code = int(d["reason"][h, i])
        samples.append(Sample(d["tokens"][h, i, :t].tolist(), d["logprobs"][h, i, :t].tolist(),
                              d["versions"][h, i, :t].tolist(),
                              None if code < 0 else sampler.REASON_NAMES[code]))
      meta = int(d["meta"][h])
      req = GroupRequest(int(d["uid"][h]), d["prompt"][h, :int(d["prompt_len"][h])].tolist(),
                         samples, int(d["resumed"][h]), None if meta < 0 else meta)
      (self._ready if d["ready"][h] else self.buffer).append(req)
    self._uids = itertools.count(int(d["next_uid"]))

  def _next_uid(self) -> int:
    """The uid the next new request gets (without consuming it)."""
    nxt = next(self._uids)
    self._uids = itertools.count(nxt)
    return nxt

  def _enforce_staleness(self, policy_version: int) -> int:
    """Restart held samples with a token older than ``policy_version − η``; returns how many.

    Complete groups held from the previous call that hold such a sample go back to the
    front of the buffer.
    """
    if self.max_staleness is None:
      return 0
    oldest = policy_version - self.max_staleness
    restarted = 0
    for req in list(self.buffer) + list(self._ready):
      for i, smp in enumerate(req.samples):
        if smp.versions and min(smp.versions) < oldest:
          req.samples[i] = Sample()
          restarted += 1
    stale = [r for r in self._ready if not r.done]
    self._ready = collections.deque(r for r in self._ready if r.done)
    self.buffer.extendleft(reversed(stale))
    return restarted


def kv_bytes(engine: RolloutEngine, groups: int) -> int:
  """KV-cache bytes the engine holds for ``groups`` slots (its own layout)."""
  return sampler.kv_cache_bytes(engine.cfg, groups, engine.M, engine.P, engine.R, True)


_REASON_CODES = {name: code for code, name in sampler.REASON_NAMES.items()}


def _check_int(name: str, value, lo: int):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
    raise RolloutError(f"{name} must be an integer >= {lo}, got {value!r}")


def _sampling_params(cfg: ModelConfig, temperature, top_k, top_p, eos_id, stop):
  """SamplingParams (device arrays) and the static ``filtered`` flag; validates ids."""
  if eos_id is None:
    eos = [-1]
  elif isinstance(eos_id, (int, np.integer)):
    eos = _as_ids([eos_id], "eos_id", cfg.vocab_size)
  else:
    eos = _as_ids(eos_id, "eos_id", cfg.vocab_size) or [-1]
  seqs = []
  for i, seq in enumerate(stop or []):
    if isinstance(seq, (int, np.integer)):
      seq = [seq]
    ids = _as_ids(seq, f"stop sequence {i}", cfg.vocab_size)
    if not ids:
      raise RolloutError(f"stop sequence {i} is empty")
    seqs.append(ids)
  W = _pow2(max([len(s) for s in seqs] or [1]), 4)  # buckets: few distinct shapes
  S = _pow2(max(len(seqs), 1), 4)
  stop_arr = np.full((S, W), -1, np.int32)
  lens = np.zeros(S, np.int32)
  for i, s in enumerate(seqs):
    stop_arr[i, W - len(s):] = s
    lens[i] = len(s)
  E = _pow2(len(eos), 4)
  eos_arr = np.full(E, -1, np.int32)
  eos_arr[:len(eos)] = eos
  sp = sampling.SamplingParams(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
                               jnp.asarray(eos_arr), jnp.asarray(stop_arr), jnp.asarray(lens))
  filtered = (top_k > 0 or top_p < 1.0) and temperature > 0
  return sp, bool(filtered)


def assemble(groups: Sequence[GroupRequest], width: int) -> Rollout:
  """Stack complete groups into a prompt-major Rollout of width ``width``."""
  rows = [(g, s) for g, req in enumerate(groups) for s in req.samples]
  B = len(rows)
  tokens = np.zeros((B, width), np.int32)
  logprobs = np.zeros((B, width), np.float32)
  versions = np.full((B, width), -1, np.int32)
  lengths = np.zeros(B, np.int32)
  reasons = np.empty(B, dtype=object)
  index = np.zeros(B, np.int32)
  for b, (g, s) in enumerate(rows):
    t = len(s.tokens)
    tokens[b, :t], logprobs[b, :t], versions[b, :t] = s.tokens, s.logprobs, s.versions
    lengths[b], reasons[b], index[b] = t, s.finish_reason, g
  mask = np.arange(width)[None, :] < lengths[:, None]
  return Rollout(tokens, mask, logprobs, versions, lengths, reasons.astype(str), index,
                 [list(r.prompt) for r in groups], np.asarray([r.uid for r in groups], np.int64),
                 {"tokens": int(lengths.sum()), "groups": len(groups)},
                 [r.meta for r in groups])


# ------------------------------------------------------------------------------ generate
def generate(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], n: int = 1,
             max_new_tokens: int = 128, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int = 0, eos_id=None, seed: int = 0, *, stop=None,
             prompt_once: bool = True, max_slots: int | None = None, mesh=None, rules=None,
             policy_version: int = 0) -> Rollout:
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
  Returns:
    Rollout with G·n rows, prompt-major: tokens int32 [G·n, max_new_tokens], mask, logprobs,
    versions, lengths, finish_reason ("eos" / "stop" / "length"), stats["kv_bytes"] and
    stats["kv_bytes_replicated"].
  """
  if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
    raise RolloutError("prompts must be a list of token-id lists")
  if len(prompts) == 0:
    raise RolloutError("prompts is empty; pass at least one prompt")
  _check_int("n", n, 1)
  _check_int("max_new_tokens", max_new_tokens, 1)
  context = cfg.max_position_embeddings
  checked = [check_prompt(p, i, cfg, max_new_tokens, context) for i, p in enumerate(prompts)]
  longest = max(len(p) for p in checked)
  groups = len(checked) if prompt_once else len(checked) * n
  slots = _pow2(groups) if max_slots is None else max_slots
  engine = RolloutEngine(cfg, n=n, max_slots=slots, max_new_tokens=max_new_tokens,
                         max_prompt_len=longest, temperature=temperature, top_p=top_p,
                         top_k=top_k, eos_id=eos_id, stop=stop, prompt_once=prompt_once,
                         seed=seed, mesh=mesh, rules=rules, context=context)
  requests = [GroupRequest(i, p, [Sample() for _ in range(n)]) for i, p in enumerate(checked)]
  complete, _ = engine.run(engine.prepare_params(params), requests,
                           policy_version=policy_version)
  complete.sort(key=lambda r: r.uid)
  out = assemble(complete, max_new_tokens)
  P, R = engine.P, engine.R
  out.stats.update(
      kv_bytes=sampler.kv_cache_bytes(engine.cfg, len(checked), n, P, R, prompt_once),
      kv_bytes_replicated=sampler.kv_cache_bytes(engine.cfg, len(checked), n, P, R, False))
  return out
