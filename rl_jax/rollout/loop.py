"""The scheduling loop of both rollout engines (one ``run`` call) and its group records.

Each iteration: apply returned environment steps (``collect``), fill free slots (groups
returning from eviction first, then new groups; ``admit``, evicting groups whose KV
time-to-live expired when work waits; resumed samples are re-prefilled, or forked from a
sample with their prompt whose tokens begin theirs, or fork the whole pages they share with
one and re-prefill the rest: ``slots.forks``), append returned observations by
incremental prefill (``extend``), record turns that ended and submit their environment
steps (``turn_ends``), and decode until the next turn ends (``decode``). With ``turn_sync``
the loop waits at each turn for every environment step of the resident samples before
anything continues.

A single-turn request is the one-turn case: a group without an episode (``spec`` None)
ends each sample with its first turn (an end id, a stop sequence or its budget: the
sampler's finish reason), and the decode call runs until a slot's samples have all finished
while work waits (or until enough groups are complete), as no environment needs a turn's
end. ``RolloutEngine`` (``engine``) and ``AgentEngine`` (``agent``) both run this loop.

With a deterministic engine the loop keeps a clock of decode steps: a step submitted at
clock t returns at t + ``result_delay`` (the loop blocks if the tool is later; a decode call
stops at the next result due; with nothing to decode the clock jumps to it), results due
together apply in (due, group, sample) order and the time-to-live counts clock steps, so
every decode batch is a function of the seeds and token counts.

Axis letters: the legend of ``rl_jax/__init__.py`` (G slots, M samples, P prompt
cache length, R trajectory cache length); Bn, Pb, Br, Be, C are the admission, prompt,
resume, extension and chunk buckets.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.envs.base import Message
from rl_jax.rollout import kv_cache, pages, prefill, slots
from rl_jax.rollout.agent_records import (AgentRollout, Trajectory, assemble_trajectories,
                                          error_count, error_kinds)
from rl_jax.rollout.env_pool import observation_ids
from rl_jax.rollout.kv_cache import REASON_NAMES
from rl_jax.rollout.decode import NEVER, decode, reads_shared_pages
from rl_jax.rollout.extend import Extension, extend, prefill_tail
from rl_jax.rollout.records import pow2

__all__ = ["DONE", "READY", "RUN", "STAT_KEYS", "WAIT", "Group", "Loop", "admission",
           "apply_outcome", "apply_outcomes", "poll_outcomes", "warmup"]

RUN, WAIT, READY, DONE = "run", "wait", "ready", "done"  # a sample's host status
STAT_KEYS = ("env_steps", "timeouts", "env_errors", "resumes", "kv_hits", "evictions",
             "reprefill_tokens", "decode_calls", "preemptions", "prefix_pages_shared",
             "forked_samples", "fork_tokens_shared")


@dataclasses.dataclass
class Cached:
  """A prefix cache entry: response ids whose K/V lies on ``pages`` (whole pages, int
  [len(ids) / S]) of pool slot shard ``shard``, after the slot prompt ``prompt``."""

  shard: int
  prompt: tuple
  ids: np.ndarray
  pages: np.ndarray


class Group:
  """A group in flight: its samples' trajectories and scheduling status.

  ``spec`` is the episode (None: a single-turn request, whose samples end with their first
  turn). ``owner`` is what ``Loop.run`` counts as complete once all its groups are (the
  group itself; a single-turn engine's ``GroupRequest``, split over several groups in the
  replicated layout). ``sample_ids`` are the samples' ids in their random streams.
  """

  def __init__(self, uid: int, prompt: list[int], trajs: list[Trajectory], spec, *,
               owner=None, sample_ids=None):
    self.uid, self.prompt, self.trajs, self.spec = uid, prompt, trajs, spec
    self.meta = None if spec is None else spec.meta
    self.owner = self if owner is None else owner
    self.sample_ids = list(range(len(trajs))) if sample_ids is None else list(sample_ids)
    self.stream = uid  # the random stream's request id (``sampling.stream_words``)
    self.skip = 0  # leading trajectory ids that are the prompt's (``DecodeState.skip``)
    self.max_turn: int | None = None  # model tokens per turn (None: the engine's)
    M = len(trajs)
    self.status = [RUN] * M
    self.budget = [0] * M  # length limit of the current turn (the device's ``budget``)
    self.turn_start = [0] * M  # trajectory index of the current turn's first model token
    self.epoch = [0] * M  # restarts (the staleness bound): late outcomes of old epochs drop
    self.resumed = 0  # calls this group was held across
    self.chunk: list[list[int] | None] = [None] * M  # observation ids waiting for ``extend``
    self.since = [0.0] * M  # when the sample's environment step was submitted (loop clock)
    self.due = [0] * M  # deterministic: the clock at which that step's result joins
    self.cut = [False] * M  # the turn ended on its budget (stop id appended)
    self.evicted = [False] * M  # KV dropped since the turn ended (a re-prefill)
    self.slot: int | None = None

  @property
  def done(self) -> bool:
    return all(s == DONE for s in self.status)

  def has(self, status: str) -> bool:
    return status in self.status

  @property
  def first_prompt(self) -> list[int]:
    """The whole prompt: the slot's ids and the ``skip`` ids opening every trajectory."""
    return list(self.prompt) + list(self.trajs[0].tokens[:self.skip])


def admission(e, batch, Bn: int, Pb: int):
  """Admission arrays of the engine ``e`` for ``batch``, (slot, group) pairs, at Bn rows and
  Pb prompt tokens, and the samples whose K/V is rebuilt: (row, sample, slot, cached
  positions) as ``slots.forks`` takes them. A fresh sample's turn budget and start are set
  on its group here. With the prompt on pages (``e.prompt_pages``) the rows hold the slots'
  prompts (first ids) and ``onto_pages`` says no sample's pages take a whole prompt yet,
  ``forked`` that none forks it (``Loop.onto_pages`` widens the rows that write theirs)."""
  a = slots.admission_rows(Bn, Pb, G=e.G, M=e.M, R=e.R, budget=min(e.max_turn, e.max_total))
  if e.prompt_pages:
    a["onto_pages"] = np.full(Bn, e.M, np.int32)
    a["forked"] = np.zeros((Bn, e.M), np.int32)
  rebuild = []
  for b, (g, grp) in enumerate(batch):
    a["slots"][b], a["prompt_len"][b], a["request_id"][b] = g, len(grp.prompt), grp.stream
    a["prompt"][b, :len(grp.prompt)] = grp.prompt
    a["sample_id"][b] = grp.sample_ids
    a["skip"][b] = grp.skip
    a["budget"][b] = min(turn_tokens(e, grp), e.max_total)
    last = None  # the sample before, and its index
    for m, t in enumerate(grp.trajs):
      n = len(t.tokens)
      if n == 0:  # a fresh sample: its first token is drawn by ``admit``
        grp.budget[m], grp.turn_start[m] = int(a["budget"][b, m]), 0
        continue
      if last and _alike(last[0], t):  # (a fresh group with the prompt on pages)
        for k in ("tokens", "logprobs", "versions"):
          a[k][b, m, :n] = a[k][b, last[1], :n]
      else:
        a["tokens"][b, m, :n] = t.tokens
        a["logprobs"][b, m, :n], a["versions"][b, m, :n] = t.logprobs, t.versions
      last = t, m
      a["length"][b, m], a["budget"][b, m] = n, grp.budget[m]
      if grp.status[m] != RUN:
        a["reason"][b, m] = kv_cache.EOS  # waiting or done: not decoding
      if grp.status[m] != DONE and n > 1:
        rebuild.append((b, m, g, n - 1))
  return a, rebuild


def _alike(t, u) -> bool:
  """Trajectories ``t`` and ``u`` hold the same tokens, log-probs and versions."""
  return t.tokens == u.tokens and t.logprobs == u.logprobs and t.versions == u.versions


class Loop:
  """One rollout call: the scheduling loop over the engine's slots.

  The engine ``eng`` gives the shapes and programs (``cfg``, ``G``, ``M``, ``P``, ``R``,
  ``S``, ``pool_plan``, ``sp``, ``admit_fn``, ...) and, with environments, their pool
  (``pool``; None for single-turn requests).
  """

  def __init__(self, eng, params, policy_version: int):
    self.e, self.params = eng, params
    self.version = jnp.int32(policy_version)
    self.key = jax.random.key(eng.seed, impl="threefry2x32")
    # a pool of every whole budget: the identity table, read in place (``decode_step``)
    self.identity = eng.pool_plan.in_place(eng.pool_pages)
    with kv_cache.mesh_context(eng.ctx):  # pages a slot's samples share read once per slot
      self.grouped = reads_shared_pages(eng.cfg, eng.Q, self.identity)
    self.state = kv_cache.init_state(eng.cfg, eng.G, eng.M, eng.P, eng.R, ctx=eng.ctx,
                                     S=eng.S, pages=eng.pool_pages, identity=self.identity)
    self.shard = pages.slot_shards(eng.G, eng.D)  # each slot's pool shard
    self.released: list[int] = []  # slots freed since their pages were last returned
    # per slot, the resumed or forked samples' (sample, response ids whose K/V their pages
    # hold since admission): sources for forks of later admissions (``slots.forks``)
    self.on_pages: dict[int, list[tuple[int, np.ndarray]]] = {}
    # the prefix cache (``eng.prefix_cache`` entries, least recently used first; a pool with
    # a page table): the whole pages of single-turn samples whose slot was freed, held
    # (``pages.hold``) for later admissions to fork, dropped when pages run short
    self.caching = eng.prefix_cache > 0 and not self.identity
    self.cache: collections.OrderedDict[int, Cached] = collections.OrderedDict()
    self.cache_keys = itertools.count()
    self.cache_hits = 0  # forks from the cache
    self.slot_group: list[Group | None] = [None] * eng.G
    self.queue: collections.deque[Group] = collections.deque()
    self.evicted: list[Group] = []
    # a fixed pool: admission order of each slot's group (preemption takes the newest), and
    # whether admission is closed since a preemption, until a group leaves its slot
    self.admitted = itertools.count()
    self.order = [0] * eng.G
    self.closed = False
    self.stats = collections.Counter({k: 0 for k in STAT_KEYS})
    self.used: list[int] = []  # pool pages in use after each decode call
    # the deterministic schedule's clock: decode steps run by this call (idle time jumps to
    # the next result due); results of steps submitted by an earlier call join at once
    self.clock = 0
    if eng.deterministic:
      for grp in eng.live.values():
        grp.due = [0] * len(grp.due)
    self.sync = eng.schedule == "turn_sync"
    self.wait_s = 0.0
    self.want = self.complete = 0  # owners to complete in ``run``, and completed so far
    # decode steps per call when no environment step is pending (None: until a turn ends);
    # a server bounds it so that new requests join and tokens stream every few steps
    self.chunk_steps: int | None = None

  def run(self, groups: list[Group], min_complete: int | None = None):
    """Serve ``groups`` until ``min_complete`` of their owners are complete (None = all).

    Returns:
      (complete owners in completion order, unfinished owners in submission order: their
      groups' partial turns are copied back to the host and their slots freed). An owner is
      its group unless the group names another (``Group.owner``).
    """
    t0 = time.perf_counter()
    owners, parts = {}, collections.defaultdict(list)
    for grp in groups:
      owners.setdefault(id(grp.owner), grp.owner)
      parts[id(grp.owner)].append(grp)
    self.want = len(owners) if min_complete is None else min(min_complete, len(owners))
    # results an earlier call's steps left first (a deterministic engine applies them all,
    # as ``export_held`` does), so a group they complete is complete before anything runs
    self.collect()
    self.submit(groups)
    complete, seen, done = [], set(), set()

    def harvest():
      # owners complete in the order their groups finish: without environments, groups
      # finished by one decode call in slot order (those finished before it first)
      new = [g for g in groups if g.done and id(g) not in done]
      if self.e.pool is None:
        new.sort(key=lambda g: -1 if g.slot is None else g.slot)
      for grp in new:
        done.add(id(grp))
        k = id(grp.owner)
        if k not in seen and all(g.done for g in parts[k]):
          seen.add(k)
          complete.append(grp.owner)
      self.complete = len(complete)

    harvest()
    while len(complete) < self.want:
      self.step()
      harvest()
    self.hold()
    self.stats["seconds"] = time.perf_counter() - t0
    return complete, [o for k, o in owners.items() if k not in seen]

  # ---------------------------------------------------------------- the online calls
  # ``submit``, ``step``, ``running_tokens`` and ``abort`` serve requests that come and go
  # while others decode (the server's lanes, ``serve.scheduler``); ``run`` is ``submit``
  # then ``step`` until enough owners are complete (the trainer's rollouts).
  def submit(self, groups: Sequence[Group]) -> None:
    """Queue ``groups``: each joins the batch at the next step with a free slot and pages
    (admission in queue order), while the resident groups keep decoding."""
    self.queue.extend(g for g in groups if not g.done)

  def abort(self, grp: Group) -> None:
    """End ``grp`` now, whatever it is doing: out of the queue, or out of its slot with its
    pages returned to the pool at once; its samples are done and a late environment
    outcome of it is dropped. Its records keep what was taken to the host."""
    if grp in self.queue:
      self.queue.remove(grp)
    grp.status = [DONE] * len(grp.status)
    self.e.live.pop(grp.uid, None)
    if grp.slot is not None:
      self.free_slot(grp.slot, grp)
      self.give_back()

  def running_tokens(self, groups: Sequence[Group]) -> dict[int, list[tuple[list, list]]]:
    """What each of ``groups`` decoding in a slot holds so far, by ``id(group)``: per sample
    (token ids, log-probs) of its response (a single-turn group) or trajectory (multi-turn)
    as the device holds it, from its first token (one device read for all groups)."""
    resident = [grp for grp in groups if grp.slot is not None and grp.has(RUN)]
    if not resident:
      return {}
    s = self.state
    tokens, logprobs, length = jax.device_get((s.tokens, s.logprobs, s.length))
    out = {}
    for grp in resident:
      g = grp.slot
      out[id(grp)] = [(tokens[g, m, :length[g, m]].tolist(),
                       logprobs[g, m, :length[g, m]].tolist()) for m in range(len(grp.trajs))]
    return out

  def hold(self, only: int | None = None):
    """Copy the partial turns of decoding samples to their records; free every slot (or
    slot ``only``)."""
    resident = [(g, grp) for g, grp in self.resident() if only is None or g == only]
    live = [(g, m, grp) for g, grp in resident for m, s in enumerate(grp.status) if s == RUN]
    if live:
      host = self.host_tokens([(g, m) for g, m, _ in live])
      for g, m, grp in live:
        self.take_tokens(host, g, m, grp)
    for g, grp in resident:
      self.free_slot(g, grp)

  def host_tokens(self, rows: Sequence[tuple[int, int]]):
    """The state's tokens, log-probs, versions and lengths on the host, and a
    mixture-of-experts model's expert records of ``rows`` ((slot, sample) pairs) only:
    {(g, m): int32 [R,Y,X]} (None for dense models). The whole record array is [G,M,R,Y,X],
    G·M rows where a call takes a few: one gather of the rows, padded to a power of two (a
    handful of small programs), is what crosses to the host."""
    s = self.state
    host = jax.device_get((s.tokens, s.logprobs, s.versions, s.length))
    routing = None
    if s.routing is not None and rows:
      pad = [rows[0]] * (pow2(len(rows)) - len(rows))
      gs, ms = np.asarray(list(rows) + pad, np.int32).T
      picked = np.asarray(jax.device_get(s.routing[gs, ms]))
      routing = {row: picked[i] for i, row in enumerate(rows)}
    return (*host, routing)

  def take_tokens(self, host, g: int, m: int, grp: Group) -> None:
    """Append sample m's tokens decoded in slot g since its record last grew (``host`` from
    ``host_tokens``); a mixture-of-experts model's expert records of the slot's tokens
    (model tokens fed by decode or ``extend``; observation tokens -1) are merged into the
    trajectory's (``slots.merged_routing``: those fed before a re-prefill are kept)."""
    tokens, logprobs, versions, length, routing = host
    t, n1 = grp.trajs[m], int(length[g, m])
    n0 = len(t.tokens)
    t.append(tokens[g, m, n0:n1], logprobs[g, m, n0:n1], versions[g, m, n0:n1], True,
             len(t.actions))
    if routing is not None:
      t.routing = slots.merged_routing(t.routing, routing[g, m][:n1])

  def per_shard(self, pairs) -> np.ndarray:
    """int [D·Q]: the pages of (slot, pages) ``pairs``, each one sample's run of consecutive
    table entries, summed over each pool shard; a run of n entries takes at most ceil(n / Q)
    of each of its slot shard's Q sequence shards (``pages.spread``; exactly n with Q = 1)."""
    Q = self.e.Q
    out = np.zeros(self.e.D * Q, np.int64)
    for g, n in pairs:
      out[self.shard[g] * Q:(self.shard[g] + 1) * Q] += pages.spread(n, Q)
    return out

  def fit(self, need) -> None:
    """A fixed pool: drop the prefix cache's least recently used entries of a short pool
    shard, then preempt its most recently admitted resident groups, until ``need()`` pages
    (int [D·Q] per shard, recomputed after each) are free on every shard; a slot shard's
    oldest group stays (its shards hold its whole budget). A preempted group keeps its
    partial turns and goes back to the front of the queue, to resume by recompute."""
    if not self.e.fixed_pool:
      return
    self.give_back()
    while True:  # a slot shard is short when one of its Q sequence shards is
      short = (need() > pages.free_pages(self.state.refs)).reshape(self.e.D, -1).any(-1)
      if any(self.drop_cached(s) for s in np.flatnonzero(short)):
        continue  # the prefix cache gives its pages back before a group is preempted
      resident = [(g, grp) for g, grp in self.resident() if short[self.shard[g]]]
      counts = collections.Counter(self.shard[g] for g, _ in resident)
      resident = [(g, grp) for g, grp in resident if counts[self.shard[g]] > 1]
      if not resident:
        break
      g, grp = max(resident, key=lambda r: self.order[r[0]])
      for m, s in enumerate(grp.status):  # an observation will need a re-prefill first
        grp.evicted[m] |= s in (WAIT, READY)
      self.hold(only=g)
      self.queue.appendleft(grp)
      self.give_back()
      self.stats["preemptions"] += 1
      self.closed = True

  def free_slot(self, g: int, grp: Group) -> None:
    """Take ``grp`` out of slot ``g``; its pages go back to the pool before the next
    admission (``give_back``), but for those the prefix cache keeps (``keep``)."""
    if self.caching and grp.spec is None:
      self.keep(g, grp)
    self.slot_group[g], grp.slot = None, None
    self.on_pages.pop(g, None)
    self.released.append(g)

  def give_back(self) -> None:
    """Return the pages of the slots freed since the last call to the pool."""
    if self.released:
      rows = np.zeros(self.e.G, bool)
      rows[self.released] = True
      self.state = kv_cache.release_slots(self.state, rows, identity=self.identity,
                                          ctx=self.e.ctx)
      self.released = []

  def room(self, pages_: np.ndarray, keep=()) -> None:
    """Grow the pool (doubling, up to every sample's whole budget) until ``pages_`` (int
    [D·Q]) are free on each shard (a fixed pool does not grow: ``fit``), after dropping
    prefix cache entries but those in ``keep`` (``trim_cache``)."""
    e = self.e
    if e.fixed_pool:
      return
    self.trim_cache(pages_, keep)
    old = self.state.refs.size
    grown = kv_cache.grow_pool(self.state, pages_, e.max_pool_pages, ctx=e.ctx)
    if grown.refs.size > old:
      e.pool_pages = grown.refs.size  # later calls start at this size
      self.stats["pool_growths"] += 1
      for c in self.cache.values():  # the kept pages' new ids
        c.pages = np.asarray(pages.regrown_ids(c.pages, old, grown.refs.size,
                                               grown.refs.shape[0]))
    self.state = grown

  # ---------------------------------------------------------------- the prefix cache
  def keep(self, g: int, grp: Group) -> None:
    """Put the whole pages of slot ``g``'s samples (single-turn: response index j on the
    sample's pages for every j below its last token, which is never fed) into the prefix
    cache, one more holder each, unless an entry with the same prompt on the slot's shard
    already holds those ids; entries the new one extends and the least recently used past
    ``prefix_cache`` entries are dropped."""
    e, row, plus, minus = self.e, None, [], []
    for m, t in enumerate(grp.trajs):
      k = max(len(t.tokens) - 1, 0) // e.S * e.S
      if k == 0:
        continue
      ids, prompt = np.asarray(t.tokens[:k], np.int32), tuple(grp.prompt)
      same = [(key, c) for key, c in self.cache.items()
              if c.shard == self.shard[g] and c.prompt == prompt]
      held = next((key for key, c in same if len(c.ids) >= k and np.array_equal(c.ids[:k], ids)),
                  None)
      if held is not None:
        self.cache.move_to_end(held)
        continue
      if row is None:
        row = np.asarray(jax.device_get(self.state.pages[g]))
      held_pages = row[m, :k // e.S]
      if (held_pages < 0).any():
        continue
      for key, c in same:  # entries the new one extends
        if np.array_equal(ids[:len(c.ids)], c.ids):
          minus.extend(self.cache.pop(key).pages)
      self.cache[next(self.cache_keys)] = Cached(int(self.shard[g]), prompt, ids, held_pages)
      plus.extend(held_pages)
    while len(self.cache) > e.prefix_cache:
      minus.extend(self.cache.popitem(last=False)[1].pages)
    self.hold_pages(plus, 1)  # before dropping: a page in both keeps a holder throughout
    self.hold_pages(minus, -1)

  def trim_cache(self, want, keep=()) -> None:
    """Drop the least recently used prefix cache entries of slot shards with a pool shard
    where fewer than ``want`` (int [D·Q], or an int) pages are free, until none is short
    or no entry but those in ``keep`` is left there."""
    while self.cache:
      free = pages.free_pages(self.state.refs)
      short = (np.broadcast_to(want, free.shape) > free).reshape(self.e.D, -1).any(-1)
      if not any(self.drop_cached(s, keep) for s in np.flatnonzero(short)):
        return

  def drop_cached(self, shard: int, keep=()) -> bool:
    """Drop the least recently used prefix cache entry on slot shard ``shard`` but those in
    ``keep`` (its pages lose a holder); False if there is none."""
    victim = next((key for key, c in self.cache.items() if c.shard == shard and key not in keep),
                  None)
    if victim is None:
      return False
    self.hold_pages(self.cache.pop(victim).pages, -1)
    return True

  def cache_only(self) -> np.ndarray:
    """int [D,Q]: the pages of each slot shard's Q sequence shards that the prefix cache
    alone holds (free once its entries there are dropped)."""
    e = self.e
    if not self.cache:
      return np.zeros((e.D, e.Q), np.int64)
    refs = np.asarray(jax.device_get(self.state.refs))
    holders = np.zeros(refs.size, np.int64)
    for c in self.cache.values():
      np.add.at(holders, c.pages, 1)
    only = ((refs.reshape(-1) == holders) & (holders > 0)).reshape(refs.shape).sum(-1)
    return only.reshape(e.D, e.Q)

  def hold_pages(self, ids, delta: int) -> None:
    """One more (``delta`` 1) or one less (-1) holder on pool pages ``ids``."""
    if len(ids):
      padded = np.full(pow2(len(ids), 8), self.state.refs.size, np.int32)
      padded[:len(ids)] = ids
      self.state = kv_cache.hold_pages(self.state, padded, delta, ctx=self.e.ctx)

  def result(self, groups: list[Group]) -> AgentRollout:
    """The AgentRollout of complete ``groups`` with this call's stats."""
    e, s = self.e, self.stats
    # rows of the slot layout's R, the budget after the whole prompt: without the prompt's ids
    out = assemble_trajectories([(g.uid, g.first_prompt, [t.after(g.skip) for t in g.trajs],
                                  g.meta) for g in groups], pow2(e.max_total, 8), e.max_turns)
    seconds = s.pop("seconds", 0.0)
    out.stats.update({k: int(v) for k, v in s.items()}, seconds=seconds,
                     env_wait_s=self.wait_s,
                     **pages.usage_counters(self.used, e.programs, self.state.refs.size),
                     kv_hit_rate=s["kv_hits"] / max(s["resumes"], 1),
                     trajectories_per_s=len(groups) * e.M / max(seconds, 1e-9))
    return out

  # ---------------------------------------------------------------- one iteration
  def resident(self):
    return [(g, grp) for g, grp in enumerate(self.slot_group) if grp is not None]

  def step(self):
    progressed = self.collect()
    if self.sync and any(grp.has(WAIT) for _, grp in self.resident()):
      self.wait()  # the barrier: every environment step of the turn returns
      return
    progressed |= self.admit()
    progressed |= self.extend()
    progressed |= self.turn_ends()
    if any(grp.has(RUN) for _, grp in self.resident()):
      self.decode()
      self.turn_ends()
    elif not progressed:
      due = self.pending_due() if self.e.deterministic else []
      if due:  # nothing to decode: the clock jumps to the next result due
        self.clock = max(self.clock, due[0][0])
      elif self.e.pool is not None or self.queue:
        self.wait()
      # else: nothing submitted, nothing running (an online loop between requests)

  def now(self) -> float:
    """The time the time-to-live counts in: decode steps (deterministic) or seconds."""
    return self.clock if self.e.deterministic else time.monotonic()

  def wait(self) -> None:
    """Block on the environments (nothing to decode); the time is ``stats["env_wait_s"]``,
    the environment time not hidden behind decoding."""
    if self.e.pool is None:
      raise RuntimeError("the rollout loop cannot admit its queued groups and has nothing "
                         "to decode")
    t0 = time.perf_counter()
    self.e.pool.wait(0.02)
    self.wait_s += time.perf_counter() - t0

  def collect(self) -> bool:
    """Apply returned environment steps: rewards, counters, observation chunks (with a
    deterministic engine: the steps due by the clock, in a fixed order, waiting for late
    ones)."""
    if self.e.pool is None:
      outcomes = False
    elif self.e.deterministic:
      outcomes = self.due_outcomes()
    else:
      outcomes = poll_outcomes(self.e, self.stats)
    for grp in list(self.evicted):
      if grp.done:
        self.evicted.remove(grp)
    for g, grp in self.resident():
      if grp.done:  # harvest: the slot is free
        self.free_slot(g, grp)
        self.closed = False
    return bool(outcomes)

  def pending_due(self) -> list[tuple[int, int, int, tuple]]:
    """(due, uid, sample, key) of every environment step still running for a live sample,
    sorted; steps of restarted samples are dropped."""
    e, out = self.e, []
    for key in e.pool.keys():
      uid, m, epoch = key
      grp = e.live.get(uid)
      if grp is None or grp.epoch[m] != epoch:
        e.pool.discard(key)  # a stale step: its outcome would be dropped
      else:
        out.append((grp.due[m], uid, m, key))
    return sorted(out)

  def due_outcomes(self) -> bool:
    """Apply the steps whose result is due by the clock, in (due, group, sample) order,
    waiting for those not back yet (the deterministic schedule)."""
    due = [key for d, _, _, key in self.pending_due() if d <= self.clock]
    if not due:
      return False
    t0 = time.perf_counter()
    outcomes = self.e.pool.take(due)
    self.wait_s += time.perf_counter() - t0
    apply_outcomes(self.e, outcomes, self.stats)
    return True

  def admit(self) -> bool:
    """Fill free slots in slot order (on every mesh alike, so which groups a call completes
    does not depend on how the pool is split): groups returning from eviction first, then
    new groups."""
    e = self.e
    free = [g for g, grp in enumerate(self.slot_group) if grp is None]
    busy = len(free) < e.G
    if self.closed and busy:
      return False  # a fixed pool preempted a group: none comes in until one leaves
    returning = [grp for grp in self.evicted if grp.has(READY)]
    want = len(returning) + len(self.queue)
    if want > len(free) and not self.sync and e.ttl is not None:
      free += self.evict(want - len(free))
    # fork sources: samples of the groups that stay in their slots and the prefix cache's
    # entries (slot numbers G + i: ``fork``) (``slots.forks``)
    resident = [(g, m, grp.prompt, ids, self.shard[g]) for g, grp in self.resident()
                for m, ids in self.on_pages.get(g, ())]
    if e.fixed_pool:  # free pages of each slot shard's Q sequence shards; the batch's
      self.give_back()
      taken = np.zeros((e.D, e.Q), np.int64)
      free_now = lambda: pages.free_pages(self.state.refs).reshape(e.D, e.Q)
      left, only = free_now(), self.cache_only()
    batch = []
    for g in free:
      nxt = returning[0] if returning else (self.queue[0] if self.queue else None)
      if nxt is None:
        break
      if e.fixed_pool:  # admit while the slot's shards hold what the group takes at once,
        s = self.shard[g]  # the prefix cache's entries there giving their pages back if so
        need = sum(pages.spread(n, e.Q) for n in group_pages(e, nxt))
        if need > (left[s] - taken[s] + only[s]).min() and (busy or batch):
          continue
        while need > (left[s] - taken[s]).min() and self.drop_cached(s):
          left, only = free_now(), self.cache_only()
        taken[s] += need
      if returning:
        grp = returning.pop(0)
        self.evicted.remove(grp)
      else:
        grp = self.queue.popleft()
      grp.slot, self.slot_group[g] = g, grp
      self.order[g] = next(self.admitted)
      batch.append((g, grp))
    if not batch:
      return False
    cached = list(self.cache.items())  # what admission left of the prefix cache
    resident += [(e.G + i, 0, c.prompt, c.ids, c.shard) for i, (_, c) in enumerate(cached)]
    self.stats["prefix_pages_shared"] += sum(shared_prompt_pages(e, grp) for _, grp in batch)
    Bn = min(e.G, pow2(len(batch), 4))
    Pb = min(e.P, pow2(max(len(grp.prompt) for _, grp in batch), 8))
    a, rebuild = admission(self.e, batch, Bn, Pb)
    shared, tails = [], []
    if e.share_prefixes:
      rebuild, shared, tails = slots.forks(a, rebuild, self.shard, resident, e.S)
    row_of = {g: b for b, (g, _) in enumerate(batch)}
    held = {(g, m): n for _, m, g, n in rebuild}
    held.update({(g, m): n for g, _, m, n, _ in shared})
    held.update({(g, m): n for _, m, g, n, _ in tails})
    for (g, m), n in held.items():  # what each one's pages hold once admitted
      self.on_pages.setdefault(g, []).append((m, a["tokens"][row_of[g], m, :n].copy()))
    used = {cached[r[4] - e.G][0] for r in shared if r[4] >= e.G}
    for key in used:  # most recently used
      self.cache.move_to_end(key)
    self.cache_hits += sum(r[4] >= e.G for r in shared)
    self.give_back()
    self.room(self.per_shard((g, n) for g, grp in batch for n in group_pages(e, grp)),
              keep=used)
    self.stats["forked_samples"] += len(shared)
    self.stats["fork_tokens_shared"] += sum(r[3] for r in shared)
    if e.prompt_pages:
      a, rebuild, shared = self.onto_pages(a, batch, rebuild, shared)
    self.state = e.admit_fn(e.cfg, self.params, self.state, prefill.Admission(**a), e.sp,
                            self.version, self.key, filtered=e.filtered,
                            fresh=not busy and Bn == e.G, ctx=e.ctx, identity=self.identity)
    self.reprefill(a, rebuild)
    self.fork(shared, [c for _, c in cached])
    self.prefill_tails(a, tails)
    return True

  def onto_pages(self, a, batch, rebuild, shared):
    """With the prompt on pages: the samples to re-prefill whose tokens are their prompt's
    ids only (a group's first sample; the others, and samples whose prompt begins like one
    on pages, fork it) are written by the admission's own prefill instead, where their
    rows' whole prompts fit the bucket ``prompt_bucket`` picks for them, and the samples of
    their groups forking them fork there too. Returns the admission arrays with those rows
    widened to their whole prompts (``onto_pages`` naming the sample, ``forked`` the
    positions its group's samples take from it; ``prefill.admit``), the samples still to
    re-prefill and the forks still to make (``fork``)."""
    e = self.e
    first = {}  # row -> its sample holding the prompt's ids only
    for b, m, _, n in rebuild:
      if n == batch[b][1].skip - 1:
        first.setdefault(b, m)
    if not first:
      return a, rebuild, shared
    whole = {b: batch[b][1].first_prompt for b in first}
    Bn, Ps = a["prompt"].shape
    Pb = max(Ps, prompt_bucket(e, [len(p) for p in whole.values()], Bn))
    whole = {b: p for b, p in whole.items() if len(p) <= Pb}
    prompt = np.zeros((Bn, Pb), np.int32)
    prompt[:, :Ps] = a["prompt"]
    a = dict(a, prompt=prompt, prompt_len=a["prompt_len"].copy(),
             onto_pages=a["onto_pages"].copy(), forked=a["forked"].copy())
    for b, p in whole.items():
      a["prompt"][b, :len(p)], a["prompt_len"][b], a["onto_pages"][b] = p, len(p), first[b]
    writer = {batch[b][0]: first[b] for b in whole}  # slot -> its writing sample
    row_of = {g: b for b, (g, _) in enumerate(batch)}
    here = lambda r: r[4] == r[0] and writer.get(r[0]) == r[1]
    for g, _, m, n, _ in filter(here, shared):  # forks of a written sample: in the admission
      a["forked"][row_of[g], m] = n
    rebuild = [r for r in rebuild if not (r[0] in whole and r[1] == first[r[0]])]
    return a, rebuild, [r for r in shared if not here(r)]

  def reprefill(self, a, rebuild) -> None:
    """Rebuild the K/V of resumed samples (``admission``'s rows) from their tokens: their
    first ``prefill_chunk`` positions by ``prefill.resume``, the rest in chunks of it
    (``prefill_tails``), before any sample forks them."""
    e, C = self.e, self.e.prefill_chunk
    resume = lambda res, _: prefill.resume(e.cfg, self.params, self.state, res, ctx=e.ctx)
    self.rebuild_pieces(a, [(b, m, g, min(n, C or n), 0) for b, m, g, n in rebuild], resume)
    self.prefill_tails(a, [(b, m, g, n, C) for b, m, g, n in rebuild if C and n > C])

  def prefill_tails(self, a, tails) -> None:
    """Rebuild the K/V of resumed samples whose first k positions are on their pages
    (``slots.forks``' tails: a source's whole pages forked; or a long re-prefill's first
    chunk) from there on (``extend.prefill_tail``), in pieces of at most ``prefill_chunk``
    positions (``slots.tail_rounds``)."""
    e = self.e
    tail = lambda res, start: prefill_tail(e.cfg, self.params, self.state, res, start,
                                           ctx=e.ctx, live=live_bucket(e, int(start.max())))
    for pieces in slots.tail_rounds(tails, e.prefill_chunk):
      self.rebuild_pieces(a, pieces, tail)

  def rebuild_pieces(self, a, pieces, program) -> None:
    """Write the K/V of positions k .. n-1 of each piece ``(row, sample, slot, n, k)`` of the
    admission arrays ``a`` onto its sample's pages: ``program(res, start)`` (a
    ``prefill.Resume`` and int32 [Br] first positions) over calls cut by
    ``slots.resume_calls``."""
    e = self.e
    for rows, (Br, T) in slots.resume_calls([n - k for *_, n, k in pieces], G=e.G, M=e.M,
                                            R=e.R, P=e.P, chunk=e.prefill_chunk):
      res, start = slots.resume_rows(Br, T, e.G), np.zeros(Br, np.int32)
      for r, (b, m, g, n, k) in enumerate(pieces[i] for i in rows):
        res.slot[r], res.sample[r], res.length[r], start[r] = g, m, n + 1, k
        part = a["tokens"][b, m, k:k + T]
        res.tokens[r, :len(part)] = part
        self.stats["reprefill_tokens"] += n - k
      self.state = program(res, start)

  def fork(self, shared, cached=()) -> None:
    """Give resumed samples the pages of a sample whose tokens begin theirs, of their group
    or of another slot of their pool shard with the same prompt, or of the prefix cache's
    entry ``cached[i]`` where the source slot is G + i (``slots.forks``: whole pages
    shared, the partial last one copied)."""
    if not shared:
      return
    e = self.e
    F = pow2(len(shared), 4)  # a few fork programs
    rows = np.zeros((5, F), np.int32)
    rows[0] = e.G  # padding rows
    rows[:, :len(shared)] = np.asarray(shared, np.int32).T
    given, use = np.full((F, e.R // e.S), -1, np.int32), np.zeros(F, bool)
    for i, r in enumerate(shared):
      if r[4] >= e.G:
        c = cached[r[4] - e.G]
        given[i, :len(c.pages)], use[i], rows[4, i] = c.pages, True, r[0]
    self.state = kv_cache.fork_samples(self.state, *rows, given, use, identity=self.identity,
                                       ctx=e.ctx)

  def evict(self, need: int) -> list[int]:
    """Free up to ``need`` slots whose groups all wait on environments past the TTL."""
    e, now, freed = self.e, self.now(), []
    for g, grp in self.resident():
      if len(freed) >= need:
        break
      if grp.has(RUN) or grp.has(READY) or not grp.has(WAIT):
        continue
      if any(now - grp.since[m] < e.ttl for m, s in enumerate(grp.status) if s == WAIT):
        continue
      for m, s in enumerate(grp.status):
        grp.evicted[m] |= s == WAIT
      self.free_slot(g, grp)
      self.evicted.append(grp)
      self.stats["evictions"] += 1
      self.closed = False
      freed.append(g)
    return freed

  def extend(self) -> bool:
    """Incremental prefill of returned observations; the samples resume decoding."""
    e = self.e
    ready = lambda: [(g, m, grp) for g, grp in self.resident()
                     for m, s in enumerate(grp.status) if s == READY]
    if not ready():
      return False
    self.fit(lambda: self.per_shard((g, -(-(len(grp.chunk[m]) + 1) // e.S) + 1)
                                    for g, m, grp in ready()))
    rows = ready()
    if not rows:
      return False
    Be = min(e.G * e.M, pow2(len(rows), 4))
    C = min(e.R, pow2(max(len(grp.chunk[m]) + 1 for _, m, grp in rows), 16))
    for i in range(0, len(rows), Be):
      x = Extension(np.full(Be, e.G, np.int32), np.zeros(Be, np.int32),
                    np.zeros(Be, np.int32), np.zeros((Be, C), np.int32),
                    np.ones(Be, np.int32), np.zeros(Be, np.int32))
      for r, (g, m, grp) in enumerate(rows[i:i + Be]):
        t, chunk = grp.trajs[m], grp.chunk[m]
        x.slot[r], x.sample[r], x.start[r] = g, m, len(t.tokens) - 1
        x.tokens[r, 0], x.tokens[r, 1:1 + len(chunk)] = t.tokens[-1], chunk
        x.count[r] = 1 + len(chunk)
        x.budget[r] = min(len(t.tokens) + len(chunk) + turn_tokens(e, grp),
                          total_tokens(e, grp))
        grp.budget[m], grp.turn_start[m] = int(x.budget[r]), len(t.tokens) + len(chunk)
        t.append(chunk, [0.0] * len(chunk), [-1] * len(chunk), False, len(t.actions) - 1)
        self.stats["resumes"] += 1
        self.stats["kv_hits"] += int(not grp.evicted[m])
        grp.evicted[m], grp.chunk[m], grp.status[m] = False, None, RUN
      self.room(self.per_shard((g, -(-c // e.S) + 1)
                               for g, c in zip(x.slot, x.count) if g < e.G))
      self.state, _ = extend(e.cfg, self.params, self.state, x, e.sp, self.version,
                             filtered=e.filtered, ctx=e.ctx,
                             live=live_bucket(e, int(x.start.max())))
    return True

  def decode(self):
    """Decode until a turn ends (continuous) or every turn of the batch ends (turn_sync);
    without environments, until a slot's samples have all finished while work waits, else
    until enough groups are complete."""
    e = self.e
    self.give_back()  # slots freed since the last admission stop decoding
    poll = e.pool is not None and not self.sync and len(e.pool) > 0
    steps = e.poll_steps if poll else (self.chunk_steps or e.R)
    if e.deterministic:  # decode up to the next result due
      due = self.pending_due()
      steps = max(due[0][0] - self.clock, 1) if due else (self.chunk_steps or e.R)
    if e.pool is None:  # no turn's end needs the host: stop for a free slot's work
      waiting = bool(self.queue) or any(grp.has(READY) for grp in self.evicted)
      slots_done, stop = 1 if waiting else max(1, self.want - self.complete), NEVER
    else:
      slots_done, stop = NEVER, e.G * e.M if self.sync else 1
    self.fit(self.pages_for_next_token)
    length, reason, active, table = jax.device_get((self.state.length, self.state.reason,
                                                    self.state.active, self.state.pages))
    run = (reason == kv_cache.RUNNING) & active[:, None]
    if not run.any():
      return
    before = self.state
    self.room(pages.next_token_pages(run, length, table, e.S, e.D, e.Q))
    live, shared = self.read_buckets(length, run, table, again=self.state is not before)
    self.state, ran = decode(e.cfg, self.params, self.state, e.sp, self.version,
                             jnp.int32(steps), jnp.int32(slots_done), jnp.int32(stop),
                             filtered=e.filtered, ctx=e.ctx, live=live,
                             identity=self.identity, shared=shared)
    self.stats["decode_calls"] += 1
    pool = int(self.state.refs.size)
    e.programs.add((live, shared, pool))
    self.used.append(pool - int(pages.free_pages(self.state.refs).sum()))
    if e.deterministic:
      self.clock += int(ran)

  def read_buckets(self, length, run, table, again: bool = True) -> tuple[int, int]:
    """The next decode's static read buckets: each running sample's live pages after its
    slot's shared ones (``live_bucket``), and the pages read once per slot, ns
    (``decode``'s ``shared``: a power of two covering the most leading pages a slot's
    running samples all name, ``pages.shared_entries``; 0 where none are or the decode
    reads each row's pages). ``length``, ``run``, ``table``: the host's copies from before
    ``room``; where pages can be shared they are read again if ``again`` (``room`` changed
    the state: a grown pool renumbers its pages)."""
    e = self.e
    if not self.grouped:
      return live_bucket(e, int(length[run].max(initial=1))), 0
    if again:
      length, reason, active, table = jax.device_get((self.state.length, self.state.reason,
                                                      self.state.active, self.state.pages))
      run = (reason == kv_cache.RUNNING) & active[:, None]
    own = pages.shared_entries(table, run, table.shape[-1], xp=np)
    most = int(own.max(initial=0))
    ns = min(1 << (most - 1).bit_length(), table.shape[-1]) if most else 0
    return live_bucket(e, int((length - own[:, None] * e.S)[run].max(initial=1))), ns

  def pages_for_next_token(self) -> np.ndarray:
    """Pages the running samples take at the next decode step, per pool shard (int [D·Q]:
    their fed token's entry has none)."""
    length, reason, active, table = jax.device_get((self.state.length, self.state.reason,
                                                    self.state.active, self.state.pages))
    run = (reason == kv_cache.RUNNING) & active[:, None]
    return pages.next_token_pages(run, length, table, self.e.S, self.e.D, self.e.Q)

  def turn_ends(self) -> bool:
    """Record the turns that ended on device: a single-turn sample is finished (with the
    sampler's reason), a multi-turn one submits its environment step."""
    e = self.e
    live = [(g, m, grp) for g, grp in self.resident() for m, s in enumerate(grp.status)
            if s == RUN]
    if not live:
      return False
    reason = np.asarray(jax.device_get(self.state.reason))
    ended = [(g, m, grp) for g, m, grp in live if reason[g, m] != kv_cache.RUNNING]
    if not ended:
      return False
    host = self.host_tokens([(g, m) for g, m, _ in ended])
    now = self.now()
    for g, m, grp in ended:
      t = grp.trajs[m]
      n0, n1 = len(t.tokens), int(host[3][g, m])
      self.take_tokens(host, g, m, grp)
      if grp.spec is None:
        t.finish, grp.status[m] = REASON_NAMES[int(reason[g, m])], DONE
        continue
      new = t.tokens[n0:n1]
      stopped = reason[g, m] == kv_cache.EOS and int(new[-1]) in e.stop
      grp.cut[m] = not stopped
      t.truncated_turn |= not stopped and n1 < total_tokens(e, grp)
      turn = t.tokens[grp.turn_start[m]:n1]
      action = e.detokenize(turn[:-1] if stopped else turn)
      t.actions.append(action)
      t.turn_ends.append(n1)
      t.messages.append(Message("assistant", action))
      history = tuple(t.messages)
      render = lambda msgs, h=history: observation_ids(e.renderer, h, msgs, e.max_obs)
      e.pool.submit((grp.uid, m, grp.epoch[m]), t.env, action, render)
      grp.status[m], grp.since[m] = WAIT, now
      grp.due[m] = self.clock + e.result_delay
    return True


def warmup(e, params) -> int:
  """Compile every program the loop runs for engine ``e`` on padding rows, so no rollout
  call compiles: admission buckets (groups x prompt length, and the all-slots-free variant),
  re-prefill buckets (samples x tokens), with environments the observations' extension
  buckets (samples x chunk length), and the extensions and the decode loop at the first
  live-page bucket (longer trajectories compile one program per further power-of-two
  bucket when they reach it). Forks (``kv_cache.fork_samples`` and
  ``extend.prefill_tail``: samples that share another's pages, ``slots.forks``) compile
  when a rollout first forks, the latter also when it first re-prefills a sample longer
  than ``prefill_chunk``. ``params``: sampler parameters. Returns the number of programs
  traced."""
  before = sum(kv_cache.TRACE_COUNTS.values())
  key, version = jax.random.key(e.seed, impl="threefry2x32"), jnp.int32(0)
  identity = e.pool_plan.in_place(e.pool_pages)  # as ``Loop`` decides it
  state = kv_cache.init_state(e.cfg, e.G, e.M, e.P, e.R, ctx=e.ctx, S=e.S, pages=e.pool_pages,
                              identity=identity)
  live = live_bucket(e, 1)
  for Bn in slots.buckets(4, e.G):
    for Pb in slots.buckets(8, pow2(e.max_prompt_len, 8)):
      for fresh in ((False, True) if Bn == e.G else (False,)):
        a, _ = admission(e, [], Bn, Pb)
        state = e.admit_fn(e.cfg, params, state, prefill.Admission(**a), e.sp, version, key,
                           filtered=e.filtered, fresh=fresh, ctx=e.ctx, identity=identity)
  for Br, T in slots.resume_shapes(G=e.G, M=e.M, R=e.R, P=e.P, chunk=e.prefill_chunk):
    state = prefill.resume(e.cfg, params, state, slots.resume_rows(Br, T, e.G), ctx=e.ctx)
  if e.pool is not None:
    for Be in slots.buckets(4, e.G * e.M):
      for C in slots.buckets(16, min(e.R, pow2(e.max_obs + 2, 16))):
        x = Extension(np.full(Be, e.G, np.int32), np.zeros(Be, np.int32), np.zeros(Be, np.int32),
                      np.zeros((Be, C), np.int32), np.ones(Be, np.int32), np.zeros(Be, np.int32))
        state, _ = extend(e.cfg, params, state, x, e.sp, version, filtered=e.filtered,
                          ctx=e.ctx, live=live)
  state = kv_cache.release_slots(state, np.ones(e.G, bool), identity=identity, ctx=e.ctx)
  state, _ = decode(e.cfg, params, state, e.sp, version, jnp.int32(1), jnp.int32(1),
                    jnp.int32(1), filtered=e.filtered, ctx=e.ctx, live=live, identity=identity)
  e.programs.add((live, 0, e.pool_pages))
  jax.block_until_ready(state)
  return sum(kv_cache.TRACE_COUNTS.values()) - before


def prompt_bucket(e, lengths: list[int], Bn: int) -> int:
  """The admission's prompt bucket Pb with the prompt on pages, for the rows whose first
  sample writes its whole prompt of ``lengths`` ids onto pages. Prompts of up to Pb ids are
  prefilled by the admission (``Loop.onto_pages``); a longer one stays at its first id and
  its first sample is re-prefilled (``Loop.reprefill``, calls cut by
  ``slots.resume_calls``). Pb minimises the tokens computed, Bn·Pb plus the re-prefill
  calls' Br·T (as whole rows: a row longer than ``prefill_chunk`` is re-prefilled in
  chunks of it, the same positions in more calls); of equal costs the larger (fewer
  calls). A bucket below the whole prompts' is taken only where it saves at least a third
  of the tokens: it adds a call and two programs to compile (an admission and a
  re-prefill), which a smaller saving does not repay where prompts are short. A function
  of the lengths alone."""
  top = pow2(max(lengths), 8)
  whole = Bn * top  # every prompt whole
  best = ((2 * whole) // 3 + 1, top)
  for Pb in reversed(slots.buckets(8, top)[:-1]):
    rest = [n - 2 for n in lengths if n > Pb]  # cached ids: all but the first and last
    floor = Bn * Pb + sum(max(e.R // 4, k) for k in rest)  # resume_shape's least T
    if floor >= best[0]:
      continue
    cost = Bn * Pb + sum(Br * T for _, (Br, T) in slots.resume_calls(rest, G=e.G, M=e.M, R=e.R))
    if cost < best[0]:
      best = (cost, Pb)
  return best[1]


def live_bucket(e, longest: int) -> int:
  """The live-page bucket of engine ``e``'s decode for a longest response of ``longest``
  tokens (``pages.live_bucket``), at least one entry per sequence shard (nb a multiple of
  Q: ``decode.split_decode_attention``)."""
  return max(pages.live_bucket(longest, e.S, e.pool_plan.NP), e.Q)


def group_pages(e, grp: Group) -> list[int]:
  """Pages each sample of ``grp`` takes as soon as it is admitted (a run of its table
  entries): its tokens so far (a fresh sample's first token: one), an observation waiting
  to be appended; none for a finished sample. With the prompt on pages and
  ``share_prefixes``, every sample but the first forks the whole pages of the prompt's
  cached ids (``Group.skip`` - 1 of them: ``slots.forks``) and takes only its entries after
  them."""
  out, shared = [], forked_prompt_pages(e, grp)
  for m, t in enumerate(grp.trajs):
    if grp.status[m] != DONE:
      extra = len(grp.chunk[m]) if grp.chunk[m] is not None else 0
      out.append(-(-(max(len(t.tokens), 1) + extra) // e.S) - (shared if out else 0))
  return out


def shared_prompt_pages(e, grp: Group) -> int:
  """Pages a per-sample copy of ``grp``'s prompt would take that its M samples share: the
  slot's prompt, read once for all of them; a prompt on pool pages (``Group.skip`` ids, the
  last of which the decode feeds), the whole pages the group's first sample writes and the
  others fork (the partial last page is copied for each)."""
  if not grp.skip:
    return (e.M - 1) * pages.pages_needed(len(grp.prompt), e.S)
  return (e.M - 1) * forked_prompt_pages(e, grp)


def forked_prompt_pages(e, grp: Group) -> int:
  """Whole pool pages of ``grp``'s prompt on pages that each sample after the group's first
  forks (``share_prefixes``) rather than writes: those of the ``Group.skip`` - 1 ids the
  first one prefills (the decode feeds the last); 0 with the prompt in the slot."""
  return (grp.skip - 1) // e.S if grp.skip and e.share_prefixes else 0


def total_tokens(e, grp: Group) -> int:
  """Ids a trajectory of ``grp`` may hold: the engine's budget after the prompt
  (``max_total``), and the prompt's ids opening it with the prompt on pages (``skip``)."""
  return grp.skip + e.max_total


def turn_tokens(e, grp: Group) -> int:
  """Model tokens per turn of ``grp``: its own limit, else the engine's ``max_turn``."""
  return e.max_turn if grp.max_turn is None else min(grp.max_turn, e.max_turn)


def apply_outcome(e, grp: Group, m: int, out) -> None:
  """Apply one environment step's outcome to sample m: reward, counters, and either the
  episode's end (done, max turns, no room left) or the observation chunk (READY)."""
  t, res = grp.trajs[m], out.result
  t.turn_rewards.append(float(res.reward))
  t.turn_timeouts.append(bool(out.timed_out))
  t.env_time += out.elapsed
  t.tool_calls += int(res.info.get("tool_calls", 0))
  t.tool_errors += error_count(res.info.get("tool_errors", 0))
  t.tool_latency += float(res.info.get("tool_latency_s", 0.0) or 0.0)
  for kind, n in error_kinds(res.info.get("tool_errors", 0)).items():
    t.error_kinds[kind] = t.error_kinds.get(kind, 0) + n
  t.timeouts += int(out.timed_out)
  t.env_errors += int(out.error is not None and not out.timed_out)
  chunk = (list(e.renderer.end_of_turn_ids[:1]) if grp.cut[m] else []) + list(out.ids)
  if res.done:
    t.finish = "done"
  elif len(t.actions) >= e.max_turns:
    t.finish = "max_turns"
  elif len(t.tokens) + len(chunk) + 1 > total_tokens(e, grp):
    t.finish = "max_tokens"  # no room for the observation and a model token
  else:
    t.truncated_obs |= out.truncated
    t.messages.extend(out.messages)
    grp.chunk[m], grp.status[m] = chunk, READY
  if t.finish is not None:
    grp.status[m] = DONE


def poll_outcomes(e, stats=None) -> bool:
  """Apply every finished environment step of the engine's live groups (never blocks);
  outcomes of restarted samples are dropped. Returns whether any step finished."""
  outcomes = e.pool.poll()
  apply_outcomes(e, outcomes, stats)
  return bool(outcomes)


def apply_outcomes(e, outcomes, stats=None) -> None:
  """Apply ``[(key, StepOutcome)]`` in order to the engine's live groups (``apply_outcome``);
  outcomes of restarted samples (another epoch) or returned groups are dropped."""
  for (uid, m, epoch), out in outcomes:
    grp = e.live.get(uid)
    if grp is None or grp.epoch[m] != epoch:
      continue  # the sample was restarted (or its group returned): a stale outcome
    apply_outcome(e, grp, m, out)
    if stats is not None:
      stats["env_steps"] += 1
      stats["timeouts"] += int(out.timed_out)
      stats["env_errors"] += int(out.error is not None and not out.timed_out)
