"""Host arrays in and out of the device slots, for the rollout loop (``loop``).

``admission_rows`` are the padding arrays an admission fills; ``forks`` picks the resumed
samples that can share another sample's pages instead of being re-prefilled; ``resume_shape``
and ``buckets`` are the shapes the loop's programs take (what a warm-up compiles), and
``resume_calls`` splits a re-prefill's rows over them (``call_fits``: no call larger than
the admission's largest), ``tail_rounds`` a long one into chunks;
``merged_routing`` keeps a resumed sample's expert records.

Axis letters: the legend of ``rl_jax/__init__.py`` (G slots, M samples per slot,
R response cache length, T resumed tokens); Bn, Pb, Br are the admission, prompt and resume
buckets.
"""

from __future__ import annotations

import numpy as np

from rl_jax.rollout.prefill import Resume

__all__ = ["admission_rows", "buckets", "call_fits", "call_limit", "common_prefix", "forks",
           "merged_routing", "resume_calls", "resume_rows", "resume_shape", "resume_shapes",
           "tail_rounds"]


def admission_rows(Bn: int, Pb: int, *, G: int, M: int, R: int, budget: int):
  """Host arrays of an all-padding ``prefill.Admission`` of Bn rows and Pb prompt tokens for
  an engine of G slots, M samples per slot and R response positions (every sample's length
  limit ``budget``); the loop's ``admission`` fills rows of it."""
  return dict(slots=np.full(Bn, G, np.int32), prompt=np.zeros((Bn, Pb), np.int32),
              prompt_len=np.ones(Bn, np.int32), tokens=np.zeros((Bn, M, R), np.int32),
              logprobs=np.zeros((Bn, M, R), np.float32),
              versions=np.full((Bn, M, R), -1, np.int32), length=np.zeros((Bn, M), np.int32),
              reason=np.zeros((Bn, M), np.int32), budget=np.full((Bn, M), budget, np.int32),
              request_id=np.zeros(Bn, np.int32),
              sample_id=np.tile(np.arange(M, dtype=np.int32), (Bn, 1)),
              skip=np.zeros((Bn, M), np.int32))


def forks(a, resume, shard=None, resident=(), page: int | None = None):
  """Split an admission's resumed samples (rows ``(row, sample, slot, cached positions)``
  of the admission arrays ``a``) into those re-prefilled, those forked, and those forked
  in part with the rest re-prefilled.

  A resumed sample whose cached tokens (all but its last) begin those of another sample
  with its K/V is forked from it (``kv_cache.fork_samples``: the other's whole pages
  shared, the partial one copied) instead of re-prefilled. Sources, in this order: a
  resumed sample of the same group (n continuations of one state, or re-rollouts from
  points of an earlier trajectory, prefill that state once); a resumed sample of another
  group of the admission with the same prompt; a sample already in a slot whose first
  positions are on its pages, or pages a prefix cache keeps (``resident``), with the same
  prompt. Another slot's sample is a source only on the same pool shard (a slot reads only
  its shard's pages). Longer
  samples are sources first. With ``page`` (the page size S), a sample that no source
  covers but that shares at least one whole page of tokens with one (the longest such
  prefix, in whole pages) forks those pages and re-prefills the rest
  (``extend.prefill_tail``): a prompt that begins with another's, e.g. one system prompt.

  A source serves a sample only if it begins with the sample's first ``min(n, S)`` tokens
  (n without a page size), so sources are looked up by those (``_Sources``): the work
  follows the samples, not samples x sources. A sample equal to the one before it in its
  row (a fresh group's samples, which all hold the prompt's ids) takes that one's choice
  while no source was added since, or forks that one where it was kept.

  Args:
    a: admission arrays (``admission_rows``). resume: the rows above. shard: int [G] the
      pool shard of each slot (None: groups fork only within themselves). resident:
      (slot, sample, prompt ids, cached ids, pool shard) of samples in slots, ``cached
      ids`` the response tokens whose K/V their pages hold (a cache's entries: a slot
      number >= G of the caller's choosing). page: S, or None for whole matches only.
  Returns:
    (resume rows re-prefilled whole, forks: list of (slot, source sample, sample, cached
    positions, source slot), tails: rows ``(row, sample, slot, cached positions, forked
    positions)`` re-prefilled from their forked positions on, each also in ``forks``).
  """
  prompts = {}

  def prompt(b):
    if b not in prompts:
      prompts[b] = tuple(a["prompt"][b, :a["prompt_len"][b]].tolist())
    return prompts[b]

  # which samples may serve each other: same row (shard None), else same shard and prompt
  scope = (lambda b, g: b) if shard is None else (lambda b, g: (int(shard[g]), prompt(b)))
  kept, out, tails = [], [], []
  admitted = _Sources()  # (row, slot, sample, ids) of the kept samples
  like = {}  # (row, ids) -> (sources then, (source slot, sample, positions, with a tail))
  held = _Sources()  # (None, slot, sample, ids) of the resident ones
  if shard is not None:
    for sg, sm, p, ids, d in resident:
      held.add((int(d), tuple(int(t) for t in p)), (None, sg, sm, np.asarray(ids)))
  for b, m, g, n in sorted(resume, key=lambda r: (r[0], -r[3], r[1])):
    row = a["tokens"][b, m, :n]
    key = (b, row.tobytes())
    if key in like and like[key][0] == len(admitted.items):  # the same sources as then
      _, (sg, sm, k, tail) = like[key]
      out.append((g, sm, m, k, sg))
      if tail:
        tails.append((b, m, g, n, k))
      continue
    h = min(n, page) if page else n
    near = admitted.find(scope(b, g), row, h)
    sources = [s for s in near if s[0] == b] + [s for s in near if s[0] != b]
    sources += held.find(scope(b, g), row, h) if shard is not None else []
    src = next(((sg, sm) for _, sg, sm, ids in sources  # (h == n: found by all n ids)
                if len(ids) >= n and (h == n or np.array_equal(ids[:n], row))), None)
    if src is not None:
      out.append((g, src[1], m, n, src[0]))
      like[key] = (len(admitted.items), (src[0], src[1], n, False))
      continue
    best = max(((common_prefix(ids, row) // page * page, sg, sm) for _, sg, sm, ids in sources),
               default=(0, 0, 0), key=lambda c: c[0]) if page else (0, 0, 0)
    if best[0] > 0:
      out.append((g, best[2], m, best[0], best[1]))
      tails.append((b, m, g, n, best[0]))
      like[key] = (len(admitted.items), (best[1], best[2], best[0], True))
    else:
      kept.append((b, m, g, n))
      admitted.add(scope(b, g), (b, g, m, row))
      like[key] = (len(admitted.items), (g, m, n, False))  # the next such sample forks it
  return kept, out, tails


class _Sources:
  """Fork sources (``forks``) in the order added, found by a scope and their first h ids.

  One lookup table per prefix length h asked for, built on first use and kept current as
  sources are added (a few lengths per admission: min(n, S) over its samples).
  """

  def __init__(self):
    self.items: list[tuple] = []  # (scope, (row, slot, sample, ids))
    self.by_len: dict[int, dict] = {}

  def add(self, scope, source) -> None:
    self.items.append((scope, source))
    for h, table in self.by_len.items():
      self._put(table, h, scope, source)

  @staticmethod
  def _put(table, h, scope, source) -> None:
    ids = source[3]
    if len(ids) >= h:
      table.setdefault((scope, tuple(ids[:h].tolist())), []).append(source)

  def find(self, scope, row, h: int) -> list[tuple]:
    """The sources of ``scope`` whose first h ids are ``row[:h]``, in the order added."""
    if h not in self.by_len:
      table = self.by_len[h] = {}
      for sc, source in self.items:
        self._put(table, h, sc, source)
    return self.by_len[h].get((scope, tuple(row[:h].tolist())), [])


def common_prefix(x, y) -> int:
  """The length of the longest common prefix of int arrays ``x`` and ``y``."""
  n = min(len(x), len(y))
  differ = np.flatnonzero(np.asarray(x[:n]) != np.asarray(y[:n]))
  return int(differ[0]) if differ.size else n


def resume_rows(Br: int, T: int, G: int) -> Resume:
  """An all-padding Resume of shape (Br, T) for an engine of G slots."""
  return Resume(np.full(Br, G, np.int32), np.zeros(Br, np.int32),
                np.zeros((Br, T), np.int32), np.ones(Br, np.int32))


def resume_shape(rows: int, longest: int, *, G: int, M: int, R: int,
                 chunk: int | None = None) -> tuple[int, int]:
  """(Br, T) bucket for re-prefilling ``rows`` samples of up to ``longest`` tokens.

  Br steps by 4x from 4 up to all G·M samples; T is R/4, R/2 or R (3 lengths), at most
  ``chunk`` (a power of two: the engine's ``prefill_chunk``; the caller cuts longer rows,
  ``tail_rounds``).
  """
  Br = 4
  while Br < rows:
    Br *= 4
  T = max(1, R // 4)
  while T < longest:
    T *= 2
  return min(Br, G * M), min(T, R, chunk or R)


def call_limit(G: int, P: int | None, chunk: int | None) -> float:
  """The most positions (rows x T) one re-prefill call computes: the admission's largest
  call, G slots x min(P, ``chunk``) prompt positions (P the engine's prompt bucket, None: the
  chunk alone), what the engine's prefill computes at once anyway. ``chunk`` None: no limit."""
  return np.inf if chunk is None else G * min(P or chunk, chunk)


def call_fits(Br: int, T: int, *, G: int, P: int | None, chunk: int | None) -> bool:
  """Whether a re-prefill call of Br rows x T positions is within ``call_limit`` or of the
  smallest row bucket (4)."""
  return Br * T <= call_limit(G, P, chunk) or Br <= 4


def resume_calls(lengths, *, G: int, M: int, R: int, P: int | None = None,
                 chunk: int | None = None) -> list[tuple[list[int], tuple[int, int]]]:
  """The re-prefill calls for rows of ``lengths`` tokens each: the rows, longest first, cut
  into runs that minimise the tokens computed (Br·T summed over the calls; a run's (Br, T)
  is ``resume_shape`` of its size and its longest row), so a few long rows do not pad every
  short one to their length; each call within ``call_fits``, so a re-prefill of many long
  rows takes several calls rather than one that outgrows the device. A function of the
  lengths alone (each at most ``chunk``, which caps T; P the engine's prompt bucket).
  Returns [(indices into ``lengths``, (Br, T))], longest rows first."""
  n = len(lengths)
  order = sorted(range(n), key=lambda i: (-lengths[i], i))
  # a call's T follows its longest (first) row, its Br its row count (``resume_shape``)
  T = np.array([resume_shape(1, lengths[i], G=G, M=M, R=R, chunk=chunk)[1] for i in order],
               np.float64)
  Br = np.array([0] + [resume_shape(k, 1, G=G, M=M, R=R)[0] for k in range(1, n + 1)])
  cost, cut = np.zeros(n + 1), np.zeros(n + 1, np.int64)
  limit = call_limit(G, P, chunk)
  for j in range(1, n + 1):  # the cheapest cut of the first j rows: a call for rows i..j-1
    k = j - np.arange(j)
    ok = (Br[k] >= k) & ((Br[k] * T[:j] <= limit) | (Br[k] <= 4))  # ``call_fits``
    c = np.where(ok, cost[:j] + Br[k] * T[:j], np.inf)
    cut[j] = int(np.argmin(c))  # the first of equal costs: fewer, longer calls
    cost[j] = c[cut[j]]
  calls, j = [], n
  while j:
    i = int(cut[j])
    calls.append((order[i:j], resume_shape(j - i, lengths[order[i]], G=G, M=M, R=R,
                                           chunk=chunk)))
    j = i
  return calls[::-1]


def resume_shapes(*, G: int, M: int, R: int, P: int | None = None,
                  chunk: int | None = None) -> list[tuple[int, int]]:
  """Every (Br, T) bucket ``resume_shape`` gives for this engine's shapes within
  ``call_fits``, sorted: what a warm-up compiles."""
  rows = [1, *(4 ** i for i in range(1, (G * M).bit_length()) if 4 ** i < G * M), G * M]
  shapes = {resume_shape(r, n, G=G, M=M, R=R, chunk=chunk) for r in rows
            for n in (R, R // 2, R // 4) if n >= 1}
  return sorted(s for s in shapes if call_fits(*s, G=G, P=P, chunk=chunk))


def tail_rounds(tails, chunk: int | None) -> list[list[tuple]]:
  """Rows ``(row, sample, slot, n, k)`` whose K/V is rebuilt from position k up to n, cut
  into pieces of at most ``chunk`` positions (None: one piece each): round i holds each row's
  i-th piece ``(row, sample, slot, end, start)``. A piece attends the positions below its
  start, so the rounds run in order; a re-prefill's memory then grows with the chunk, not
  with the response budget (its scores are [rows, heads, chunk, prompt + budget])."""
  rounds: list[list[tuple]] = []
  for b, m, g, n, k in tails:
    step = chunk or max(n - k, 1)
    for i, start in enumerate(range(k, n, step)):
      if i == len(rounds):
        rounds.append([])
      rounds[i].append((b, m, g, min(n, start + step), start))
  return rounds


def buckets(lo: int, top: int) -> list[int]:
  """Every value ``min(top, pow2(n, lo))`` takes for n = 1 .. top (powers of two from ``lo``,
  capped at ``top``): the admission, prompt and extension buckets a warm-up compiles."""
  return sorted({min(top, lo << i) for i in range(max(1, top).bit_length() + 1)})


def merged_routing(old, new: np.ndarray) -> np.ndarray:
  """A sample's expert records [t,Y,X]: this slot's, and for tokens it holds no record of
  (a resumed sample's earlier tokens, fed before it was aborted) the earlier ones."""
  new = np.array(new)
  if old is not None and len(old):
    n = min(len(old), len(new))
    keep = new[:n, :1] < 0
    new[:n] = np.where(keep, old[:n], new[:n])
  return new
