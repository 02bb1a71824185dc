"""Continuous batching of concurrent HTTP requests over the rollout engine.

One thread owns the device work. Each distinct sampling setting (temperature, top-p, top-k)
is a *lane*: a ``RolloutEngine`` (one sample per group; each choice a single-turn group)
and its scheduling loop (``loop.Loop``), kept across requests. A request's n choices are n
groups submitted to its lane (the loop's online calls: ``submit``, ``step``,
``running_tokens``, ``abort``); every iteration of the thread admits queued groups into free
slots (prefill), decodes every running sample a few steps (``poll_steps``) and reports the
new tokens of each choice, so requests that arrive while others decode join the batch at the
next iteration and leave it as soon as they end (Orca-style iteration-level scheduling). The
paged KV cache takes pages as tokens are written and returns a choice's pages when it ends,
is stopped by a stop string, or its client disconnects (``Scheduler.cancel``); with the
prompt on pages, choices whose prompts begin alike share the pages of what they have in
common (``share_prompts``), a shared page returns when the last of them ends, and an ended
choice's whole pages stay in a prefix cache for later requests (``prefix_cache``). Lanes share
the engine's compiled programs (sampling settings are traced values); at most ``max_lanes``
exist at once, an idle one is dropped to make room.

Randomness. Every token is drawn with the uniform of (server seed, stream, token index), the
stream being a function of the request's ``seed`` and the choice index when the request gives
a seed (the same request gives the same tokens in any batch, at any load), else of a counter.

A choice ends with ``finish`` "stop" (an end-of-turn or eos id, or a stop string: the text
is cut before it), or "length" (``max_tokens``). The ids and log-probs it returns exclude
the end id. Log-probs are the engine's: of the distribution each token was drawn from
(tempered and filtered; 0 for greedy draws).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import queue
import threading
from typing import Any, Callable, Sequence

import numpy as np

from rl_jax.rollout.engine import FORK_STATS, RolloutEngine
from rl_jax.rollout.records import RolloutError, pow2
from rl_jax.rollout.loop import Group, Loop
from rl_jax.rollout.agent_records import Trajectory

__all__ = ["Chunk", "Request", "Sampling", "Scheduler", "choice_pages", "stream_id"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """A lane's sampling setting (temperature 0 is greedy)."""

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0


@dataclasses.dataclass
class Chunk:
  """New output of one choice: text to append, the ids and log-probs it came from, and the
  finish reason when the choice ended (None while it runs)."""

  index: int
  text: str
  ids: list[int]
  logprobs: list[float]
  finish: str | None = None


def stream_id(*words: int) -> int:
  """A 31-bit random-stream id (``request_id`` of the engine) from integer words."""
  seq = np.random.SeedSequence([int(w) & 0xFFFFFFFF for w in words])
  return int(seq.generate_state(1, np.uint32)[0] >> 1)


class _Choice:
  """One choice's progress: ids and text reported so far (its group's first ``Group.skip``
  ids are the prompt's, not output: ``Scheduler.prompt_pages``)."""

  def __init__(self, index: int, group: Group):
    self.index, self.group = index, group
    self.ids: list[int] = []
    self.logprobs: list[float] = []
    self.text, self.sent = "", 0  # the whole text so far, characters reported
    self.finish: str | None = None


class Request:
  """One HTTP request: ``n`` choices from one prompt, reported through ``on_chunk`` (called
  on the scheduler thread with a Chunk: new text as it is generated when streaming, else each
  whole choice when it ends; ``None`` after the last chunk; an exception if the engine
  failed).

  Args:
    prompt: token ids. n: choices. max_tokens: model tokens per choice. sampling: Sampling.
    seed: the request's seed (None: a fresh stream per choice). stop: stop strings.
    stream: report text as it is generated (else only when each choice ends).
  """

  def __init__(self, prompt: Sequence[int], n: int, max_tokens: int, sampling: Sampling, *,
               seed: int | None = None, stop: Sequence[str] = (), stream: bool = False,
               on_chunk: Callable[[Any], None] = lambda chunk: None):
    self.prompt, self.n, self.max_tokens = [int(t) for t in prompt], int(n), int(max_tokens)
    self.sampling, self.seed, self.stop = sampling, seed, tuple(s for s in stop if s)
    self.stream, self.on_chunk = bool(stream), on_chunk
    self.choices: list[_Choice] = []
    self.cancelled = False
    self.done = threading.Event()

  def result(self) -> list[Chunk]:
    """Every choice whole (after ``done``)."""
    return [Chunk(c.index, c.text, c.ids, c.logprobs, c.finish) for c in self.choices]


class _Lane:
  """One sampling setting: an engine, its persistent loop, and the choices it serves."""

  def __init__(self, sched: "Scheduler", sampling: Sampling):
    m = sched.model
    self.on_pages = sched.prompt_pages
    head = 1 if self.on_pages else sched.max_prompt_tokens  # prompt ids in the slot's cache
    self.engine = RolloutEngine(
        m.cfg, n=1, max_slots=sched.max_slots,
        max_new_tokens=sched.max_tokens + sched.max_prompt_tokens - head,
        max_prompt_len=head, temperature=sampling.temperature,
        top_p=sampling.top_p, top_k=sampling.top_k, eos_id=list(m.stop_ids), seed=sched.seed,
        page_size=sched.page_size, kv_pages=sched.kv_pages, context=sched.context,
        share_prefixes=sched.share_prompts,
        prefix_cache=sched.prefix_cache if self.on_pages and sched.share_prompts else 0)
    self.params = self.engine.prepare_params(m.params)
    self.loop = Loop(self.engine, self.params, 0)
    self.loop.chunk_steps = sched.poll_steps  # new requests join every few decode steps
    self.active: dict[int, tuple[Request, _Choice]] = {}
    self.uids = itertools.count()
    self.cache_stats = (0, 0, 0)  # the prefix cache's hits, entries, pages (``publish``)

  def publish(self) -> None:
    """Snapshot the prefix cache's counters for the HTTP side (on the serving thread)."""
    loop = self.loop
    self.cache_stats = (loop.cache_hits, len(loop.cache),
                        sum(len(c.pages) for c in loop.cache.values()))

  def add(self, req: Request, streams: Sequence[int]) -> None:
    head = 1 if self.on_pages else len(req.prompt)
    rest = req.prompt[head:]
    for i, stream in enumerate(streams):
      uid = next(self.uids)
      # a one-turn group without an episode: the choice ends with its first turn. The
      # prompt's ids after ``head`` open its sample as ids it did not sample (written onto
      # its pages when it is admitted, as a resumed sample's are), so its KV takes pages
      # as long as the prompt is, not the slot's worst case.
      t = Trajectory(None, [], list(rest), [0.0] * len(rest), [-1] * len(rest),
                     [False] * len(rest), [0] * len(rest))
      grp = Group(uid, req.prompt[:head], [t], None)
      # its tokens draw the uniforms they draw with the whole prompt in the slot's cache
      grp.stream, grp.max_turn, grp.skip = stream, req.max_tokens, len(rest)
      grp.budget = [len(rest) + req.max_tokens]
      choice = _Choice(i, grp)
      req.choices.append(choice)
      self.loop.submit([grp])
      self.active[uid] = (req, choice)

  def drop(self, uid: int) -> None:
    """Stop choice ``uid``: out of the queue, or out of its slot with its pages returned."""
    _, choice = self.active.pop(uid)
    self.loop.abort(choice.group)


def choice_pages(max_prompt_tokens: int, max_tokens: int, page_size: int,
                 prompt_pages: bool) -> int:
  """Pool pages of one choice's whole budget: its output (and with ``prompt_pages`` its
  prompt after the first id) rounded up to the engine's response cache length, a power of
  two (``core.EngineCore``), in pages of ``page_size`` tokens (at most that length)."""
  head = 1 if prompt_pages else max_prompt_tokens
  R = pow2(max_tokens + max_prompt_tokens - head, 8)
  return R // min(page_size, R)


class Scheduler:
  """The serving thread (module docstring).

  Args:
    model: ``checkpoint.ServedModel``. max_slots: choices decoded together per lane.
    max_prompt_tokens: longest prompt. max_tokens: most model tokens per choice.
    page_size: tokens per KV page. seed: base seed of every random stream.
    max_lanes: sampling settings served at once. poll_steps: decode steps between reports.
    prompt_pages: a choice's prompt goes onto pool pages after its first id, so its KV
      takes pages as long as the prompt is (``--prompt-pages``); off: every slot holds
      ``max_prompt_tokens`` positions of prompt cache whatever the prompt's length, read in
      place by the decode, which on CPU is faster than gathering the prompt's pages
      (``scripts/bench_serve_prompts.py``).
    share_prompts: with ``prompt_pages``, a choice whose prompt is that of another choice
      decoding on the same pool shard (another of its request's n, or a concurrent
      request's) takes that choice's whole prompt pages instead of prefilling them (the
      partial last page copied; ``slots.forks``): the prompt is prefilled and held once. A
      prompt that only begins like another's (one system prompt, other questions) takes
      the whole pages they have in common and prefills the rest.
    prefix_cache: with ``prompt_pages`` and ``share_prompts``, the whole pages of this many
      ended choices (prompt and output, least recently used dropped first, and whenever
      the pool runs short) stay for later requests to take: a chat's next request, whose
      prompt is the last one's with its answer and a new message, prefills only what is
      new.
    kv_pages: a fixed pool of this many pages (``--kv-pages``; at least one choice's whole
      budget: ``choice_pages``): when the choices decoding need more, the prefix cache's
      least recently used entries give theirs back first, then the most recently admitted
      choice is preempted and resumes by recompute, drawing the same tokens (its client
      sees no difference but the wait). None: the pool grows as the choices need.
  """

  def __init__(self, model, *, max_slots: int = 8, max_prompt_tokens: int = 1024,
               max_tokens: int = 512, page_size: int = 64, seed: int = 0, max_lanes: int = 4,
               poll_steps: int = 8, prompt_pages: bool = False, share_prompts: bool = True,
               prefix_cache: int = 64, kv_pages: int | None = None):
    self.model, self.prompt_pages = model, bool(prompt_pages)
    self.share_prompts, self.prefix_cache = bool(share_prompts), int(prefix_cache)
    self.context = int(model.cfg.max_position_embeddings)
    self.max_slots, self.max_prompt_tokens = int(max_slots), int(max_prompt_tokens)
    self.max_tokens, self.page_size, self.seed = int(max_tokens), int(page_size), int(seed)
    self.max_lanes, self.poll_steps = int(max_lanes), int(poll_steps)
    need = choice_pages(self.max_prompt_tokens, self.max_tokens, self.page_size,
                        self.prompt_pages)
    if kv_pages is not None and (isinstance(kv_pages, bool) or int(kv_pages) < need):
      raise RolloutError(f"kv_pages={kv_pages!r} holds less than one choice's whole budget: "
                         f"{need} pages (choice_pages)")
    self.kv_pages = None if kv_pages is None else int(kv_pages)
    self.stop_ids = set(model.stop_ids)
    self._inbox: queue.Queue = queue.Queue()
    self._lanes: collections.OrderedDict[Sampling, _Lane] = collections.OrderedDict()
    self._waiting: collections.deque[Request] = collections.deque()
    self._counter = itertools.count()
    self._closed = False
    self.stats = collections.Counter()
    # the fork counters of lanes no longer served (its keys fixed: read by the HTTP side)
    self._dropped = collections.Counter({k: 0 for k in FORK_STATS})
    self._thread = threading.Thread(target=self._run, name="rl_jax-serve", daemon=True)
    self._thread.start()

  # ---------------------------------------------------------------- the HTTP side
  def submit(self, req: Request) -> None:
    """Queue a request (validated by the caller); its chunks arrive through ``on_chunk``."""
    if self._closed:
      raise RuntimeError("the scheduler is closed")
    self._inbox.put(("submit", req))

  def cancel(self, req: Request) -> None:
    """Stop a request's unfinished choices (a client that went away); their pages return."""
    req.cancelled = True
    self._inbox.put(("cancel", req))

  def close(self) -> None:
    self._closed = True
    self._inbox.put(("close", None))
    self._thread.join(timeout=30)

  def active_choices(self) -> int:
    """Choices queued or decoding (read from the HTTP side for /health)."""
    return sum(len(lane.active) for lane in list(self._lanes.values()))

  def shared_prompts(self) -> dict[str, int]:
    """Since the start, over every lane (read from the HTTP side for /health): choices
    that forked another's prompt pages (``share_prompts``) and the prompt positions they
    took instead of prefilling them."""
    total = collections.Counter(self._dropped)
    for lane in list(self._lanes.values()):
      total.update({k: lane.loop.stats[k] for k in FORK_STATS})
    return {"forked_choices": int(total["forked_samples"]),
            "prompt_tokens_shared": int(total["fork_tokens_shared"])}

  def cached_prefixes(self) -> dict[str, int]:
    """The prefix cache over the lanes served now, as of their last iteration: choices
    that forked its pages since each lane started, and the entries and pages it holds."""
    stats = [lane.cache_stats for lane in list(self._lanes.values())]
    return {name: int(sum(s[i] for s in stats)) for i, name in enumerate(
        ("prefix_cache_hits", "prefix_cache_entries", "prefix_cache_pages"))}

  # ---------------------------------------------------------------- the serving thread
  def _run(self) -> None:
    while True:
      busy = any(lane.active for lane in self._lanes.values())
      try:  # block for work only when there is nothing to decode
        item = (self._inbox.get_nowait() if busy
                else self._inbox.get(timeout=0.05 if self._waiting else None))
      except queue.Empty:
        item = None
      while item is not None:
        kind, req = item
        if kind == "close":
          self._fail_all(RuntimeError("the server is shutting down"))
          return
        (self._place if kind == "submit" else self._cancel)(req)
        try:
          item = self._inbox.get_nowait()
        except queue.Empty:
          item = None
      self._place_waiting()
      for lane in [lane for lane in self._lanes.values() if lane.active]:
        try:
          lane.loop.step()
          self._report(lane)
        except Exception as e:  # the engine failed: its requests fail, the server serves on
          log.exception("serving lane %s failed", lane)
          self._fail_lane(lane, e)

  def _streams(self, req: Request) -> list[int]:
    if req.seed is not None:
      return [stream_id(req.seed, i, 0) for i in range(req.n)]
    return [stream_id(self.seed, next(self._counter), 1) for _ in range(req.n)]

  def _place(self, req: Request) -> None:
    self._waiting.append(req)
    self._place_waiting()

  def _place_waiting(self) -> None:
    """Give waiting requests to their lanes, creating lanes (dropping idle ones) as allowed."""
    while self._waiting:
      req = self._waiting[0]
      if req.cancelled:
        self._waiting.popleft()
        self._finish(req)
        continue
      lane = self._lanes.get(req.sampling)
      if lane is None:
        if len(self._lanes) >= self.max_lanes:
          idle = [s for s, l in self._lanes.items() if not l.active]
          if not idle:
            return  # every lane is busy with other settings: wait for one to empty
          self._drop_lane(idle[0])
        try:
          lane = self._lanes[req.sampling] = _Lane(self, req.sampling)
        except Exception as e:  # pylint: disable=broad-except
          self._waiting.popleft()
          req.on_chunk(e)
          req.done.set()
          continue
      self._waiting.popleft()
      self._lanes.move_to_end(req.sampling)
      lane.add(req, self._streams(req))
      self.stats["requests"] += 1

  def _drop_lane(self, key: Sampling) -> None:
    gone = self._lanes.pop(key)
    self._dropped.update({k: gone.loop.stats[k] for k in FORK_STATS})

  def _cancel(self, req: Request) -> None:
    for lane in self._lanes.values():
      for uid, (r, choice) in list(lane.active.items()):
        if r is req:
          lane.drop(uid)
          choice.finish = choice.finish or "cancelled"
          self.stats["cancelled_choices"] += 1
      lane.publish()
    if all(c.finish for c in req.choices) and not req.done.is_set():
      self._finish(req)

  def _finish(self, req: Request) -> None:
    req.done.set()
    req.on_chunk(None)

  def _fail_lane(self, lane: _Lane, error: Exception) -> None:
    reqs = {id(r): r for r, _ in lane.active.values()}
    for key, l in list(self._lanes.items()):
      if l is lane:
        self._drop_lane(key)
    for req in reqs.values():
      req.on_chunk(error)
      req.done.set()

  def _fail_all(self, error: Exception) -> None:
    for lane in list(self._lanes.values()):
      self._fail_lane(lane, error)
    while self._waiting:
      req = self._waiting.popleft()
      req.on_chunk(error)
      req.done.set()

  # ---------------------------------------------------------------- progress
  def _report(self, lane: _Lane) -> None:
    """Report every choice's new tokens; end choices that finished or hit a stop string."""
    live = [(uid, req, ch) for uid, (req, ch) in lane.active.items()]
    running = lane.loop.running_tokens([ch.group for _, req, ch in live
                                        if (req.stream or req.stop) and not ch.group.done])
    for uid, req, ch in live:
      grp, t = ch.group, ch.group.trajs[0]
      if grp.done:
        ids = [tok for tok, model in zip(t.tokens, t.model) if model]
        lps = [lp for lp, model in zip(t.logprobs, t.model) if model]
        ended = bool(ids) and ids[-1] in self.stop_ids
        self._update(lane, uid, req, ch, ids[:-1] if ended else ids,
                     lps[:-1] if ended else lps, "stop" if ended else "length")
      elif id(grp) in running:
        ids, lps = (x[grp.skip:] for x in running[id(grp)][0])
        if ids and ids[-1] in self.stop_ids:
          ids, lps = ids[:-1], lps[:-1]
        self._update(lane, uid, req, ch, ids, lps, None)
    lane.publish()

  def _update(self, lane: _Lane, uid: int, req: Request, ch: _Choice, ids: list[int],
              lps: list[float], finish: str | None) -> None:
    """Move choice ``ch`` to ``ids``: apply stop strings, report the new text."""
    if len(ids) <= len(ch.ids) and finish is None:
      return
    text = self.model.tokenizer.decode(ids)
    if req.stop:
      cut = _first_stop(text, req.stop)
      if cut is not None:  # the choice ends at the stop string: keep the ids that reach it
        k = len(ch.ids)
        while k < len(ids) and _first_stop(self.model.tokenizer.decode(ids[:k + 1]),
                                           req.stop) is None:
          k += 1
        ids, lps, text, finish = ids[:k + 1], lps[:k + 1], text[:cut], "stop"
    new_ids, new_lps = ids[len(ch.ids):], lps[len(ch.ids):]
    ch.ids, ch.logprobs, ch.text = list(ids), list(lps), text
    if finish is None:
      ready = len(_safe_prefix(text, req.stop))
    else:
      ready = len(text)
      ch.finish = finish
      if uid in lane.active:
        lane.drop(uid)
      self.stats["choices"] += 1
      self.stats["completion_tokens"] += len(ids)
    if req.stream and (ready > ch.sent or new_ids or finish):
      req.on_chunk(Chunk(ch.index, text[ch.sent:ready], new_ids, new_lps, finish))
      ch.sent = max(ch.sent, ready)
    elif not req.stream and finish is not None:  # the whole choice at once
      req.on_chunk(Chunk(ch.index, text, list(ids), list(lps), finish))
    if finish is not None and all(c.finish for c in req.choices):
      lane.publish()  # what a client reads once its request is done
      self._finish(req)


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
  """Index of the earliest stop string in ``text``, None if none occurs."""
  hits = [i for i in (text.find(s) for s in stops) if i >= 0]
  return min(hits) if hits else None


def _safe_prefix(text: str, stops: Sequence[str]) -> str:
  """``text`` without an unfinished character at its end nor a tail that may begin a stop
  string (streamed text is never taken back)."""
  text = text.rstrip("\ufffd")
  hold = 0
  for s in stops:
    for k in range(min(len(s) - 1, len(text)), 0, -1):
      if text.endswith(s[:k]):
        hold = max(hold, k)
        break
  return text[:len(text) - hold]
