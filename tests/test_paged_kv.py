"""The paged response cache: the same tokens and log-probs as one worst-case page per sample,
across page sizes, pools small enough to preempt, pool growth and meshes; log-probs equal
teacher forcing; page bookkeeping against plain Python reference counts; bad inputs."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

import pallas_kernels
from rl_jax import models, rollout, sharding
from rl_jax.rollout import decode as decode_lib
from rl_jax.rollout import extend as extend_lib
from rl_jax.rollout import loop as loop_lib
from rl_jax.rollout import pages, prefill
from rl_jax.rollout.loop import group_pages
from tests.test_rollout import _teacher_forced_logits

CFG = models.ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=4400)
PARAMS = models.init_params(CFG, jax.random.key(0), std=0.2)
PROMPTS = [[(7 * i + j) % 60 + 1 for j in range(1 + i % 6)] for i in range(6)]
M, MAX_NEW = 3, 32
EOS = [3, 17, 40]  # lengths spread over 1..MAX_NEW, some samples run to the budget


def _gen(prompts=PROMPTS, temperature=1.0, **kw):
  kw = dict(dict(n=M, max_new_tokens=MAX_NEW, eos_id=EOS, seed=3), **kw)
  return rollout.generate(CFG, PARAMS, prompts, temperature=temperature, **kw)


@pytest.fixture(scope="module")
def reference():
  """One page per sample (page size >= the response budget): the worst-case slot layout."""
  return {t: _gen(temperature=t, page_size=MAX_NEW) for t in (0.0, 1.0)}


def _same(out, ref):
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.mask, ref.mask)
  np.testing.assert_array_equal(out.finish_reason, ref.finish_reason)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_pages_of_any_size_and_a_preempting_pool_give_the_slot_layouts_tokens(reference,
                                                                              temperature):
  ref = reference[temperature]
  assert ref.lengths.min() < ref.lengths.max() == MAX_NEW  # spread, some at the budget
  assert ref.stats["decode_buckets"] == 1 and ref.stats["preemptions"] == 0
  # a fixed pool of every sample's budget (8 slots x 3 samples x 8 pages): pages are taken
  # as tokens are written and returned as groups leave (a growing pool this small starts at
  # every budget and reads it in place, as the reference does)
  grown = _gen(temperature=temperature, page_size=4, kv_pages=8 * M * MAX_NEW // 4)
  _same(grown, ref)
  # a fixed pool of one group's budget (3 samples x 8 pages): groups are preempted and
  # resumed by recompute, drawing the same tokens
  small = _gen(temperature=temperature, page_size=4, kv_pages=M * MAX_NEW // 4)
  _same(small, ref)
  assert small.stats["preemptions"] > 0
  assert small.stats["kv_pages_used_peak"] <= M * MAX_NEW // 4
  # pages are taken as tokens are written: never more than the tokens need
  assert grown.stats["kv_pages_used_peak"] <= np.ceil(ref.lengths / 4).sum()
  assert grown.stats["prefix_pages_shared"] == sum(
      (M - 1) * -(-len(p) // 4) for p in PROMPTS)


def test_a_preempted_sample_is_re_prefilled_in_chunks_of_prefill_chunk(reference,
                                                                       monkeypatch):
  """``prefill_chunk`` bounds a re-prefill as it bounds a prompt's prefill: a preempted
  sample's first 4 positions are rebuilt by ``prefill.resume``, the rest by
  ``extend.prefill_tail`` pieces of at most 4 positions, each attending the pieces before it.
  The slot layout's tokens and log-probs, and the same re-prefilled positions as whole
  re-prefills (the default chunk of 2048 is longer than any sample here)."""
  calls = []  # (function, rows, tokens, first position of each row, positions of each row)

  def record(name, fn, tail):
    def call(cfg, params, state, res, *args, **kw):
      start = np.asarray(args[0]) if tail else np.zeros(len(res.slot), np.int32)
      real = res.slot < len(state.active)
      calls.append((name, *res.tokens.shape, start[real], (res.length - 1 - start)[real]))
      return fn(cfg, params, state, res, *args, **kw)
    return call

  monkeypatch.setattr(prefill, "resume", record("resume", prefill.resume, False))
  monkeypatch.setattr(loop_lib, "prefill_tail", record("tail", loop_lib.prefill_tail, True))
  kw = dict(temperature=1.0, page_size=4, kv_pages=M * MAX_NEW // 4)
  chunked = _gen(prefill_chunk=4, **kw)
  by_chunk = list(calls)
  calls.clear()
  whole = _gen(**kw)
  _same(chunked, reference[1.0])
  _same(whole, reference[1.0])
  assert chunked.stats["preemptions"] > 0
  positions = lambda rows: sum(int(n.sum()) for *_, n in rows)
  assert positions(by_chunk) == positions(calls) > 0
  assert all(T <= 4 for _, _, T, _, _ in by_chunk)
  assert max(T for _, _, T, _, _ in calls) > 4  # the whole re-prefills: longer than a chunk
  pieces = [(s, n) for name, _, _, start, count in by_chunk if name == "tail"
            for s, n in zip(start, count) if n > 0]
  assert pieces and all(s % 4 == 0 and 0 < n <= 4 for s, n in pieces)
  assert max(s for s, _ in pieces) >= 8  # three pieces or more of one sample


def test_paged_logprobs_equal_teacher_forcing():
  T = 0.9
  out = _gen(temperature=T, page_size=2, kv_pages=M * MAX_NEW // 2, max_slots=4)
  assert out.stats["preemptions"] > 0
  rows = [PROMPTS[r // M] for r in range(len(PROMPTS) * M)]
  z = _teacher_forced_logits(CFG, PARAMS, rows, out.tokens) / T
  ref = np.take_along_axis(z - scipy.special.logsumexp(z, axis=-1, keepdims=True),
                           out.tokens[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(np.where(out.mask, out.logprobs, 0), np.where(out.mask, ref, 0),
                             atol=1e-5, rtol=0)


# prompts of 4 to 29 tokens, each its own first id; a stop sequence that would end prompt
# 0's samples at their first token if its last id (1) counted as a sampled one
LONG_PROMPTS = [[(6 * i + 3 * j) % 60 + 1 for j in range(4 + 5 * i)][::-1] for i in range(6)]
STOP_AFTER_1 = [[1, t] for t in range(CFG.vocab_size)]


@pytest.fixture(scope="module")
def long_prompts():
  """The long prompts in the slot's cache, one page per sample."""
  ref = _gen(prompts=LONG_PROMPTS, stop=STOP_AFTER_1, page_size=MAX_NEW)
  assert (ref.finish_reason == "stop").any()  # never at the first token of prompt 0's rows
  assert ref.lengths[:M].min() > 1
  return ref


# the preempting pool and 8 devices in the slow set: the preempted and resumed samples of
# APRIL with the prompts on pages (test_rollout_engine.py), a busy fixed pool's admission of
# prompts on pages (below), 8 devices of the slot layout (test_paged_on_8_devices_equals_1)
@pytest.mark.parametrize("page_size,kv_pages,mesh", [
    (4, 8 * M * 64 // 4, None),
    pytest.param(2, M * 64 // 2, None, marks=pytest.mark.slow),
    pytest.param(4, M * 64 // 4, {"fsdp": 4, "tensor": 2}, marks=pytest.mark.slow)])
def test_prompts_on_pages_draw_the_slot_prompts_tokens(long_prompts, page_size, kv_pages, mesh,
                                                      monkeypatch):
  """``prompt_pages``: each prompt's ids after its first lie on pool pages, written onto the
  group's first sample's by the admission's prefill and forked by the others (whole pages
  shared, the partial one copied), and the decode reads the forked pages once per group.
  Tokens, ends and log-probs are those of the prompt in the slot's cache (their uniforms
  skip the prompt's ids: ``DecodeState.skip``, stop sequences too), in a fixed pool of
  every sample's budget (pages taken as tokens are written), a pool of one group's budget
  (preempting) and on 8 devices; log-probs equal teacher forcing."""
  assert LONG_PROMPTS[0][-1] == 1
  ctx = {} if mesh is None else dict(mesh=sharding.make_mesh(mesh), rules="fsdp_tp")
  shared = []  # the decode calls' buckets of pages read once per group
  real = rollout.loop.decode
  monkeypatch.setattr(rollout.loop, "decode",
                      lambda *a, **kw: shared.append(kw["shared"]) or real(*a, **kw))
  resumed, resume = [], rollout.prefill.resume  # re-prefill calls
  monkeypatch.setattr(rollout.prefill, "resume",
                      lambda *a, **kw: resumed.append(1) or resume(*a, **kw))
  out = _gen(prompts=LONG_PROMPTS, stop=STOP_AFTER_1, page_size=page_size, kv_pages=kv_pages,
             prompt_pages=True, **ctx)
  _same(out, long_prompts)
  assert max(shared) >= (len(LONG_PROMPTS[-1]) - 2) // page_size
  if kv_pages == 8 * M * 64 // 4:  # the response cache's 64 positions: 28 prompt ids, 32 new
    assert out.stats["preemptions"] == 0
    # the admission writes the prompt's cached ids (all but the last, which the decode
    # feeds) onto the first sample's pages, nothing is re-prefilled, the 2 others fork
    assert out.stats["forked_samples"] == (M - 1) * len(LONG_PROMPTS)
    assert not resumed
    assert out.stats["prefix_pages_shared"] == sum(
        (M - 1) * ((len(p) - 2) // page_size) for p in LONG_PROMPTS)
    # pages in use: each sample's prompt ids and response, less the pages the forks share
    pages_of = lambda n: -(-n // page_size)
    held = sum(pages_of(len(p) - 1 + out.lengths[g * M + m])
               - (m > 0) * ((len(p) - 2) // page_size)
               for g, p in enumerate(LONG_PROMPTS) for m in range(M))
    assert out.stats["kv_pages_used_peak"] <= held
    # admission counts them once: a group's first sample takes the prompt's 7 pages, the
    # others one each (the page holding the prompt's end, copied)
    eng = rollout.RolloutEngine(CFG, n=M, max_new_tokens=MAX_NEW, max_prompt_len=29,
                                page_size=4, prompt_pages=True)
    grp, = eng.groups_of(eng.new_request(LONG_PROMPTS[5]))
    assert grp.prompt == LONG_PROMPTS[5][:1] and grp.skip == 28
    assert group_pages(eng, grp) == [7, 1, 1]
  elif mesh is None:
    assert out.stats["preemptions"] > 0 and resumed  # preempted samples are re-prefilled
    rows = [LONG_PROMPTS[r // M] for r in range(len(LONG_PROMPTS) * M)]
    z = _teacher_forced_logits(CFG, PARAMS, rows, out.tokens)
    lp = np.take_along_axis(z - scipy.special.logsumexp(z, axis=-1, keepdims=True),
                            out.tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.where(out.mask, out.logprobs, 0), np.where(out.mask, lp, 0),
                               atol=1e-5, rtol=0)


def test_a_long_prompt_among_short_ones_is_re_prefilled_the_others_admitted_whole(monkeypatch):
  """With the prompt on pages an admission prefills whole the prompts that fit its bucket
  and re-prefills the first sample of a longer one (``loop.prompt_bucket``): 7 prompts of
  5-10 ids and one of 200 come in together at a bucket of 8 (8 rows of 256 would compute
  more), the 5 that fit whole, the first samples of the 3 others re-prefilled in one call
  (the 200 ids', padded to 256, covers them), and draw the slot layout's tokens and
  log-probs."""
  prompts = [[(5 * i + j) % 60 + 1 for j in range(5 + i % 6)] for i in range(7)]
  prompts.append([(7 * j) % 60 + 1 for j in range(200)])
  ref = _gen(prompts=prompts, page_size=8, max_new_tokens=8)
  buckets, resumed = [], []
  bucket, resume = rollout.loop.prompt_bucket, rollout.prefill.resume
  monkeypatch.setattr(rollout.loop, "prompt_bucket",
                      lambda *a: buckets.append(bucket(*a)) or buckets[-1])
  monkeypatch.setattr(rollout.prefill, "resume",
                      lambda *a, **kw: resumed.append(np.asarray(a[3].length)) or resume(*a, **kw))
  out = _gen(prompts=prompts, page_size=16, prompt_pages=True, max_new_tokens=8)
  _same(out, ref)
  assert buckets == [8]
  # one call; each row's ids after the prompt's first (the decode feeds the last)
  assert len(resumed) == 1 and sorted(resumed[0])[-3:] == [8, 9, 199]


def _on_pages(state, slot, sample, n):
  """Keys and values [L,n,K,H] of response indices 0 .. n-1 of (slot, sample), read through
  the page table (pool keys [Pg,K,H,S], values [Pg,K,S,H])."""
  S = state.suffix_v[0].shape[2]
  page = np.asarray(state.pages)[slot, sample, np.arange(n) // S]
  at = np.arange(n) % S
  k = np.stack([np.asarray(c)[page, :, :, at] for c in state.suffix_k])
  v = np.stack([np.asarray(c)[page, :, at, :] for c in state.suffix_v])
  return k, v


def test_the_admissions_prefill_writes_the_prompt_onto_pages_as_a_resume_does():
  """``prefill.admit`` with ``onto_pages`` (the prompt on pages: whole prompts in, the
  slot keeping the first id) writes the K/V of each prompt's ids after the first and
  before the last onto the named sample's pages: what admitting the first id and
  re-prefilling the sample's tokens (``prefill.resume``: the two-program path it
  replaces) writes, to float rounding; no other sample takes pages, and a row naming no
  sample (M) writes none."""
  G, M, R, S = 4, 3, 64, 4
  prompts = [LONG_PROMPTS[5], LONG_PROMPTS[2], LONG_PROMPTS[4]]  # 29, 14 and 24 ids
  who = [1, 0, M]  # the sample taking each prompt's pages; the last row none
  sp = rollout.RolloutEngine(CFG, n=M, max_new_tokens=8, max_prompt_len=29).sp
  key, version = jax.random.key(0, impl="threefry2x32"), jnp.int32(0)
  blank = lambda: rollout.kv_cache.init_state(CFG, G, M, 8, R, S=S, pages=G * M * R // S)

  def rows(Pb, whole):
    a = rollout.slots.admission_rows(4, Pb, G=G, M=M, R=R, budget=R)
    for b, p in enumerate(prompts):
      a["slots"][b] = b
      head = p if whole else p[:1]
      a["prompt"][b, :len(head)], a["prompt_len"][b] = head, len(head)
      a["tokens"][b, :, :len(p) - 1] = p[1:]  # each trajectory opens with the prompt's ids
      a["length"][b], a["skip"][b] = len(p) - 1, len(p) - 1
    return a

  a = rows(32, True)
  a["onto_pages"] = np.array(who + [M], np.int32)
  one = rollout.prefill.admit(CFG, PARAMS, blank(), rollout.prefill.Admission(**a), sp,
                              version, key, filtered=False)
  two = rollout.prefill.admit(CFG, PARAMS, blank(), rollout.prefill.Admission(**rows(8, False)),
                              sp, version, key, filtered=False)
  res = rollout.slots.resume_rows(4, 32, G)
  for r, (g, (p, m)) in enumerate(zip(range(2), zip(prompts, who))):
    res.slot[r], res.sample[r], res.length[r] = g, m, len(p) - 1
    res.tokens[r, :len(p) - 1] = p[1:]
  two = rollout.prefill.resume(CFG, PARAMS, two, res)
  np.testing.assert_array_equal(np.asarray(one.prefix_len), np.asarray(two.prefix_len))
  assert np.asarray(one.prefix_len)[:3].tolist() == [1, 1, 1]
  np.testing.assert_allclose(np.asarray(one.prefix_k[0])[:3, ..., :1],
                             np.asarray(two.prefix_k[0])[:3, ..., :1], atol=1e-6)
  table = np.asarray(one.pages)
  for g, (p, m) in enumerate(zip(prompts, who)):
    taken = (table[g] >= 0).sum(-1).tolist()
    want = [-(-(len(p) - 2) // S) if s == m else 0 for s in range(M)]
    assert taken == want == (np.asarray(two.pages)[g] >= 0).sum(-1).tolist()
    if m < M:
      for x, y in zip(_on_pages(one, g, m, len(p) - 2), _on_pages(two, g, m, len(p) - 2)):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(np.asarray(one.length), np.asarray(two.length))


@pytest.mark.parametrize("live", [None, 4])
def test_a_tail_reading_the_live_pages_before_it_writes_what_a_whole_re_prefill_does(live):
  """``extend.prefill_tail`` of positions 12 .. of two samples whose first 12 are on their
  pages (written by ``prefill.resume``), attending the prompt and only the first ``live``
  of their 16 pages (the bucket of 16 positions covering the 12; None: every page), writes
  the K/V that one ``prefill.resume`` of the whole rows writes, to float rounding."""
  G, Mx, R, S, k = 2, 2, 64, 4, 12
  sp = rollout.RolloutEngine(CFG, n=Mx, max_new_tokens=8, max_prompt_len=8).sp
  key, version = jax.random.key(0, impl="threefry2x32"), jnp.int32(0)
  a = rollout.slots.admission_rows(4, 8, G=G, M=Mx, R=R, budget=R)
  rng = np.random.default_rng(0)
  rows = [(0, 1, rng.integers(1, 60, 30)), (1, 0, rng.integers(1, 60, 23))]
  for g, p in enumerate(PROMPTS[2:4]):
    a["slots"][g], a["prompt_len"][g] = g, len(p)
    a["prompt"][g, :len(p)] = p

  def admitted():
    state = rollout.kv_cache.init_state(CFG, G, Mx, 8, R, S=S, pages=G * Mx * R // S)
    return rollout.prefill.admit(CFG, PARAMS, state, rollout.prefill.Admission(**a), sp,
                                 version, key, filtered=False)

  def resume(state, upto):
    res = rollout.slots.resume_rows(4, 32, G)
    for r, (g, m, toks) in enumerate(rows):
      n = min(len(toks), upto)
      res.slot[r], res.sample[r], res.length[r] = g, m, n + 1 if n < len(toks) else n
      res.tokens[r, :n] = toks[:n]
    return rollout.prefill.resume(CFG, PARAMS, state, res)

  whole = resume(admitted(), R)
  tail = resume(admitted(), k)
  res, start = rollout.slots.resume_rows(4, 32, G), np.zeros(4, np.int32)
  for r, (g, m, toks) in enumerate(rows):
    res.slot[r], res.sample[r], res.length[r], start[r] = g, m, len(toks), k
    res.tokens[r, :len(toks) - k] = toks[k:]
  tail = extend_lib.prefill_tail(CFG, PARAMS, tail, res, start, live=live)
  for g, m, toks in rows:
    assert (np.asarray(tail.pages)[g, m] >= 0).sum() == -(-(len(toks) - 1) // S)
    for x, y in zip(_on_pages(tail, g, m, len(toks) - 1), _on_pages(whole, g, m, len(toks) - 1)):
      np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)


@pytest.mark.parametrize("identity", [False, True])
def test_the_admission_forks_the_written_prompt_as_a_fork_after_it_does(identity):
  """``prefill.admit`` with ``forked`` (the group's samples take the written prompt's pages
  in the admission's own program) leaves what the admission followed by
  ``kv_cache.fork_samples`` (the call it replaces) leaves: the writer's whole pages shared
  with their holders counted, the partial last page copied, the same K/V on every page;
  with an identity table, each sample's own pages filled."""
  G, M, R, S = 4, 3, 64, 4
  prompts = [LONG_PROMPTS[5], LONG_PROMPTS[2], LONG_PROMPTS[4]]  # 27, 12, 22 ids on pages
  who = [1, 0, 2]
  forked = [[27, 0, 27], [0, 12, 5], [22, 0, 0]]  # 5: a shorter prefix of the writer's
  sp = rollout.RolloutEngine(CFG, n=M, max_new_tokens=8, max_prompt_len=29).sp
  key, version = jax.random.key(0, impl="threefry2x32"), jnp.int32(0)
  blank = lambda: rollout.kv_cache.init_state(CFG, G, M, 8, R, S=S, pages=G * M * R // S,
                                              identity=identity)
  a = rollout.slots.admission_rows(4, 32, G=G, M=M, R=R, budget=R)
  for b, p in enumerate(prompts):
    a["slots"][b], a["prompt"][b, :len(p)], a["prompt_len"][b] = b, p, len(p)
    a["tokens"][b, :, :len(p) - 1] = p[1:]
    a["length"][b], a["skip"][b] = len(p) - 1, len(p) - 1
  a["onto_pages"] = np.array(who + [M], np.int32)
  admit = lambda forks: rollout.prefill.admit(
      CFG, PARAMS, blank(), rollout.prefill.Admission(**a, forked=forks), sp, version, key,
      filtered=False, identity=identity)
  one = admit(np.array(forked + [[0] * M], np.int32))
  two = admit(None)
  rows = [(g, who[g], m, n, g) for g in range(3) for m, n in enumerate(forked[g]) if n]
  cols = np.full((5, 8), G, np.int32)
  cols[:, :len(rows)] = np.asarray(rows, np.int32).T
  two = rollout.kv_cache.fork_samples(two, *cols, identity=identity)
  t1, t2 = np.asarray(one.pages), np.asarray(two.pages)
  for g, m, n in [(g, m, n) for g in range(3) for m, n in enumerate(forked[g]) if n]:
    whole = n // S
    if not identity:
      assert (t1[g, m] >= 0).sum() == (t2[g, m] >= 0).sum() == -(-n // S)
    shared_ = lambda t: t[g, m, :whole] == t[g, who[g], :whole]
    assert shared_(t1).all() == (not identity) and shared_(t2).all() == (not identity)
    for x, y, z in zip(_on_pages(one, g, m, n), _on_pages(two, g, m, n),
                       _on_pages(one, g, who[g], n)):
      np.testing.assert_array_equal(x, y)
      np.testing.assert_array_equal(x, z)
  np.testing.assert_array_equal(np.sort(np.asarray(one.refs), None),
                                np.sort(np.asarray(two.refs), None))


def test_a_busy_fixed_pool_keeps_the_prefix_cache_when_dropping_it_would_not_admit():
  """A fixed pool of 16 pages of 4 with a prefix cache, the prompts on pages: a finished
  group's 6 whole pages stay in the cache, and a group whose prompt begins with its prompt
  forks 4 of them. While that one decodes, a group with a new prompt (31 ids on pages: 8
  pages) needs more than are free even with the 2 pages the cache alone holds: it waits in
  the queue and the cache keeps its entry (dropping it would admit nothing). It is admitted
  once a slot's group leaves, and samples the tokens of an engine that keeps nothing."""
  kw = dict(n=1, max_slots=2, max_new_tokens=8, max_prompt_len=32, page_size=4, kv_pages=16,
            prompt_pages=True, seed=3)
  eng = rollout.RolloutEngine(CFG, prefix_cache=4, **kw)
  loop = rollout.Loop(eng, eng.prepare_params(PARAMS), 0)
  loop.chunk_steps = 1
  x = [(5 * j) % 60 + 1 for j in range(20)]
  z = [(7 * j + 3) % 60 + 1 for j in range(32)]
  free = lambda: int(pages.free_pages(loop.state.refs).sum())

  def serve(prompt):
    grp, = eng.groups_of(eng.new_request(prompt))
    loop.submit([grp])
    return grp

  first = serve(x)
  while first.slot is not None or not first.done:  # a done group leaves at the next step
    loop.step()
  # 19 prompt ids and 8 tokens: the whole pages of the 26 fed
  entry, = loop.cache.values()
  assert len(entry.pages) == 6 and free() == 10
  longer = x + [t for t in range(48, 61) if t != entry.ids[19]][:12]
  again = serve(longer)
  loop.step()
  # the 4 whole pages of the 19 ids in common forked from the cache, 4 pages of its own
  assert loop.cache_hits == 1 and again.slot == 0 and free() == 6
  assert loop.cache_only().tolist() == [[2]]
  while free() + 2 >= 8 and not again.done:  # until those and the cache's own are short of 8
    loop.step()
  assert not again.done
  other = serve(z)
  loop.step()
  assert other.slot is None and [*loop.cache.values()][0] is entry  # waits; entry kept
  assert len(loop.cache) == 1
  while not (again.done and other.done):
    loop.step()
  plain = rollout.RolloutEngine(CFG, **kw)  # its programs: the same shapes
  (want,), _ = plain.run(plain.prepare_params(PARAMS),
                         [rollout.GroupRequest(2, z, [rollout.Sample()])])  # z's stream: uid 2
  assert other.trajs[0].tokens[31:] == want.samples[0].tokens and len(want.samples[0].tokens) == 8


@pytest.fixture(scope="module")
def rare_end():
  """One device's rollout with one rare end id: most samples run to the budget."""
  return _gen(page_size=MAX_NEW, eos_id=[60])


def test_paged_on_8_devices_equals_1(reference, rare_end):
  """8 slots over fsdp=4 (kv heads over tensor=2): the pool is split in 4 shards, each of
  ``kv_pages`` = one group's budget, and a shard that runs out preempts one of its own two
  slots' groups; the tokens are one device's."""
  mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
  _same(_gen(page_size=4, kv_pages=M * MAX_NEW // 4, mesh=mesh, rules="fsdp_tp"),
        reference[1.0])
  # a shard's two groups need more pages than it holds
  out = _gen(page_size=4, kv_pages=M * MAX_NEW // 4, mesh=mesh, rules="fsdp_tp", eos_id=[60])
  _same(out, rare_end)
  assert out.stats["preemptions"] > 0
  # more pages in use at once than one device holds, at most the four shards' together
  assert M * MAX_NEW // 4 < out.stats["kv_pages_used_peak"] <= 4 * M * MAX_NEW // 4


def test_paged_on_a_sequence_mesh_equals_1(rare_end):
  """8 slots over fsdp=2, each slot shard's pages over sequence=4 (a sample's table entries
  round-robin over the four): every device holds an eighth of the pool, and a fixed pool of
  ``kv_pages`` = one group's share per device preempts; the tokens are one device's, and
  the compiled decode moves no page between devices (only the partial softmaxes are merged
  across the sequence devices)."""
  mesh = sharding.make_mesh({"fsdp": 2, "sequence": 4})
  ctx = (mesh, sharding.get_rules("fsdp_tp"))
  assert rollout.kv_cache.pool_shards(8, ctx) == 2
  assert rollout.kv_cache.sequence_shards(8, ctx) == 4
  assert rollout.kv_cache.sequence_shards(8) == 1  # off a mesh
  per_device = M * MAX_NEW // 4 // 4  # one group: 3 samples x 8 entries over 4 devices
  out = _gen(page_size=4, kv_pages=per_device, mesh=mesh, rules="fsdp_tp", eos_id=[60])
  _same(out, rare_end)
  assert out.stats["preemptions"] > 0
  assert 2 * per_device < out.stats["kv_pages_used_peak"] <= 8 * per_device
  G, P, R, S, Pg = 8, 8, 64, 4, 8 * 128
  state = rollout.kv_cache.init_state(CFG, G, M, P, R, ctx, S=S, pages=Pg)
  pool = state.suffix_k[0]
  assert pool.sharding.shard_shape(pool.shape)[0] == Pg // 8 and state.refs.shape == (8, Pg // 8)
  sp = rollout.records.sampling_params(CFG, 1.0, 0, 1.0, EOS, None)[0]
  i32 = jnp.int32(4)
  hlo = rollout.sampler.decode.lower(CFG, PARAMS, state, sp, i32, i32, i32, i32, filtered=False,
                                     ctx=ctx, live=8).compile().as_text()
  shard = math.prod(pool.sharding.shard_shape(pool.shape))  # one layer's keys, per device
  moved = re.findall(r"= \w+\[([\d,]*)\]\S* (?:all-gather|all-reduce|all-to-all|"
                     r"collective-permute)", hlo)
  assert moved  # the merge of the sequence devices' partial softmaxes
  assert all(math.prod(int(d) for d in dims.split(",") if d) < shard for dims in moved), moved


def test_forks_growing_pools_and_short_budgets_on_meshes(reference):
  """Samples forked from response prefixes on fsdp=4 x tensor=2 and on fsdp=2 x sequence=4
  sample one device's tokens; a growing pool split over the sequence devices too; and one
  page per sample, which does not split over four sequence devices, keeps the pool whole
  on them with the same tokens."""
  heads = [[5, 6, 7, 8, 9][:n] for n in (5, 2, 0, 4, 1, 3)]
  kw = dict(page_size=4, kv_pages=2 * M * MAX_NEW // 4, prefixes=heads)
  want = _gen(**kw)
  forked = _gen(mesh=sharding.make_mesh({"fsdp": 4, "tensor": 2}), rules="fsdp_tp", **kw)
  _same(forked, want)
  assert forked.stats["forked_samples"] > 0
  mesh = sharding.make_mesh({"fsdp": 2, "sequence": 4})
  forked = _gen(mesh=mesh, rules="fsdp_tp", **dict(kw, kv_pages=kw["kv_pages"] // 4))
  _same(forked, want)
  assert forked.stats["forked_samples"] > 0
  _same(_gen(page_size=4, mesh=mesh, rules="fsdp_tp"), reference[1.0])
  assert rollout.kv_cache.sequence_shards(8, (mesh, sharding.get_rules("fsdp_tp")),
                                          entries=1) == 1
  _same(_gen(page_size=MAX_NEW, mesh=mesh, rules="fsdp_tp"), reference[1.0])


def test_the_pool_is_split_over_the_slots_devices():
  """With 8 slots over fsdp=4 each device holds a quarter of the pool's pages (its kv heads
  over tensor=2), and the compiled decode reads and writes them where they lie: no
  collective of the program moves as much as one shard of a layer's pool."""
  mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
  ctx = (mesh, sharding.get_rules("fsdp_tp"))
  G, P, R, S, Pg = 8, 8, 64, 4, 4 * 256
  assert rollout.kv_cache.pool_shards(G, ctx) == 4 and rollout.kv_cache.pool_shards(G) == 1
  state = rollout.kv_cache.init_state(CFG, G, M, P, R, ctx, S=S, pages=Pg)
  for pool in (state.suffix_k[0], state.suffix_v[0]):
    assert pool.sharding.shard_shape(pool.shape)[:2] == (Pg // 4, CFG.num_kv_heads // 2)
  assert state.refs.shape == (4, Pg // 4)
  sp = rollout.records.sampling_params(CFG, 1.0, 0, 1.0, EOS, None)[0]
  i32 = jnp.int32(4)
  hlo = rollout.sampler.decode.lower(CFG, PARAMS, state, sp, i32, i32, i32, i32, filtered=False,
                                     ctx=ctx, live=4).compile().as_text()
  shard = Pg // 4 * CFG.num_kv_heads // 2 * CFG.head_dim * S  # one layer's keys, per device
  moved = [(op, dims) for dims, op in re.findall(
      r"= \w+\[([\d,]*)\]\S* (all-gather|all-reduce|all-to-all|collective-permute)", hlo)]
  assert moved  # the program has collectives (kv heads over tensor), none of pool size
  assert all(np.prod([int(d) for d in dims.split(",") if d]) < shard for _, dims in moved), moved


def test_cost_follows_the_tokens_not_the_budget():
  """A 4096-token budget holds and reads what a 256-token one does for the same tokens."""
  short = _gen(max_new_tokens=256, page_size=16, eos_id=list(range(3, 61, 4)))
  long = _gen(max_new_tokens=4096, page_size=16, eos_id=list(range(3, 61, 4)))
  assert short.lengths.max() < 128
  np.testing.assert_array_equal(long.tokens[:, :256], short.tokens)
  np.testing.assert_allclose(long.logprobs[:, :256], short.logprobs, atol=1e-5, rtol=0)
  assert long.stats["kv_bytes"] == short.stats["kv_bytes"]
  assert long.stats["decode_buckets"] == short.stats["decode_buckets"] == 1  # 128-token floor
  assert long.stats["kv_bytes_replicated"] > 10 * long.stats["kv_bytes"]


def _plain_attention(q, pk, pv, plen, pool_k, pool_v, table, start, length):
  """float64 softmax attention of each sample's query heads q [G,M,N,H] over its prompt's
  first ``plen`` [G] keys (pk [G,K,H,P], pv [G,K,P,H]) and its response positions
  start <= j < length ([G,M]), rebuilt position by position from the pool through
  ``table`` [G,M,NP] (pages of S = pool_v.shape[2])."""
  G, M, N, H = q.shape
  K, S = pk.shape[1], pool_v.shape[2]
  want = np.zeros((G, M, N, H))
  for g in range(G):
    for m in range(M):
      pos = range(start[g, m], length[g, m])
      for n in range(N):
        kv = n // (N // K)
        keys = np.concatenate([pk[g, kv, :, :plen[g]].T,
                               [pool_k[table[g, m, j // S], kv, :, j % S] for j in pos]])
        vals = np.concatenate([pv[g, kv, :plen[g]],
                               [pool_v[table[g, m, j // S], kv, j % S] for j in pos]])
        w = scipy.special.softmax(keys @ q[g, m, n] / np.sqrt(H))
        want[g, m, n] = w @ vals
  return want


def test_paged_decode_attention_reads_shuffled_and_in_place_pages_as_plain_attention():
  """The decode query over page-major live pages (``pages.live_pages`` of a shuffled table,
  and ``pages.in_place`` of the identity table; one pool, or two shards each read by its own
  slot) equals float64 softmax attention over the
  prompt's valid keys then the sample's valid response keys, rebuilt position by position
  from the pool in numpy; unused table entries (-1) and a page read twice are harmless."""
  rng = np.random.default_rng(2)
  G, M, P, N, K, H, S, NP = 2, 3, 5, 4, 2, 8, 4, 4

  @functools.partial(jax.jit, static_argnames=("identity", "nb", "D"))
  def attend(q, pk, pv, pvalid, pool_k, pool_v, table, svalid, identity, nb, D):
    live = (pages.in_place(pool_k, pool_v, G, M, nb, D) if identity else
            pages.live_pages(pool_k, pool_v, table, D))
    return rollout.sampler.paged_decode_attention(q, pk, pv, pvalid, *live, svalid)

  for identity, nb, D in [(False, 3, 1), (True, 2, 1), (True, 4, 1), (False, 3, 2),
                          (True, 2, 2)]:
    Pg = G * M * NP + (4 if D > 1 and not identity else 0) + (3 if D == 1 else 0)
    Pl = Pg // D  # D shards: slot g's pages among g·Pl .. (each slot its own shard here)
    pool_k, pool_v = rng.standard_normal((Pg, K, H, S)), rng.standard_normal((Pg, K, S, H))
    table = (np.asarray(pages.identity_table(G, M, NP, D)) if identity else
             np.stack([g * Pl + rng.permutation(Pl)[:M * NP].reshape(M, NP)
                       for g in range(G)]).astype(np.int32) if D > 1 else
             rng.permutation(Pg)[:G * M * NP].reshape(G, M, NP).astype(np.int32))
    slen = rng.integers(1, nb * S + 1, (G, M))
    if not identity:  # entries past a sample's length hold no page
      table = np.where(np.arange(NP) * S < slen[..., None], table, -1)
    q = rng.standard_normal((G, M, N, H))
    pk, pv = rng.standard_normal((G, K, H, P)), rng.standard_normal((G, K, P, H))
    plen = rng.integers(1, P + 1, G)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    if identity and D > 1:  # every page of a slot's samples in its own shard
      assert set(table.reshape(G, -1)[G - 1].tolist()) == set(range(Pg - Pl, Pg))
    svalid = np.arange(nb * S)[None, None, :] < slen[..., None]
    got = attend(f32(q), f32(pk), f32(pv), jnp.asarray(np.arange(P)[None, :] < plen[:, None]),
                 f32(pool_k), f32(pool_v), jnp.asarray(table[:, :, :nb]), jnp.asarray(svalid),
                 identity=identity, nb=nb, D=D)
    want = _plain_attention(q, pk, pv, plen, pool_k, pool_v, table, np.zeros_like(slen), slen)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("D", [1, 2])
def test_pages_a_slots_samples_share_are_read_once_as_plain_attention(D):
  """A table whose slots' samples name the same leading pages (forks: 3, 1 and 2 of them;
  slot 3's odd sample out is not running, so it does not count; slot 1 has one running
  sample: nothing to read once), split by ``pages.shared_table`` and ``pages.own_entries``
  into the pages read once per slot (``pages.shared_cache``) and each sample's own after
  them, then read by ``paged_decode_attention(shared=)``: float64 softmax attention over
  the prompt's keys and every position of the sample's full table, rebuilt from the pool in
  numpy. The shared count on the host (numpy) equals the device's (jnp)."""
  rng = np.random.default_rng(7)
  G, M, P, N, K, H, S, NP, ns, nb = 4, 3, 5, 4, 2, 8, 4, 6, 4, 4
  forks = [3, 1, 0, 2]  # leading entries each slot's samples name alike
  Pl = G * M * NP // D
  table = np.full((G, M, NP), -1, np.int32)
  for g in range(G):
    ids = iter((g // (G // D)) * Pl + rng.permutation(Pl))  # slot g's pages on its shard
    common = [next(ids) for _ in range(forks[g])]
    for m in range(M):
      table[g, m] = common + [next(ids) for _ in range(NP - forks[g])]
  table[3, 1, 0] = table[3, 1, 5]  # differs from the start, but not running
  run = np.ones((G, M), bool)
  run[3, 1] = run[1, 1:] = False
  slen = np.minimum(np.array(forks)[:, None] * S + rng.integers(1, nb * S + 1, (G, M)), NP * S)
  table = np.where(np.arange(NP) * S < slen[..., None], table, -1)  # no page past the length
  want_own = np.array([3, 0, 0, 2])
  np.testing.assert_array_equal(pages.shared_entries(table, run, ns, xp=np), want_own)
  np.testing.assert_array_equal(pages.shared_entries(jnp.asarray(table), jnp.asarray(run), ns),
                                want_own)
  pool_k = rng.standard_normal((G * M * NP, K, H, S))
  pool_v = rng.standard_normal((G * M * NP, K, S, H))
  q = rng.standard_normal((G, M, N, H))
  pk, pv = rng.standard_normal((G, K, H, P)), rng.standard_normal((G, K, P, H))
  plen = rng.integers(1, P + 1, G)

  @jax.jit
  def attend(q, pk, pv, pvalid, pool_k, pool_v, table, run, slen):
    own, once = pages.shared_table(table, run, ns)
    mine = pages.own_entries(table, own, nb)
    own = own[:, None, None]
    pos = own * S + jnp.arange(nb * S)  # positions of the own keys read
    sh_pos = jnp.arange(ns * S)
    shared = (*pages.shared_cache(pool_k, pool_v, once, D), sh_pos < own * S)
    return own[:, 0, 0], rollout.sampler.paged_decode_attention(
        q, pk, pv, pvalid, *pages.live_pages(pool_k, pool_v, mine, D),
        pos < slen[..., None], shared=shared)

  f32 = lambda a: jnp.asarray(a, jnp.float32)
  own, got = attend(f32(q), f32(pk), f32(pv), jnp.asarray(np.arange(P)[None, :] < plen[:, None]),
                    f32(pool_k), f32(pool_v), jnp.asarray(table), jnp.asarray(run),
                    jnp.asarray(slen, jnp.int32))
  np.testing.assert_array_equal(own, want_own)
  want = _plain_attention(q, pk, pv, plen, pool_k, pool_v, table, np.zeros_like(slen), slen)
  np.testing.assert_allclose(np.asarray(got)[run], want[run], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("on_mesh", [False, True])
def test_a_pool_split_over_sequence_shards_attends_as_plain_attention(on_mesh, monkeypatch):
  """Pages of 2 slot shards x 2 sequence shards taken by ``pages.allocate`` (entry e of a
  slot of slot shard d from shard 2d + e mod 2), read by ``split_decode_attention`` with
  each shard attending its own entries (``pages.by_sequence``) and the parts merged by
  log-sum-exp, equal float64 softmax attention over the prompt's valid keys and the
  sample's valid response keys (sliding starts included; short rows have keys on one
  sequence shard only). Off a mesh the shards are mapped (the jnp reference); on fsdp 2 x
  sequence 2 x tensor 2 under a TPU target every device runs the Pallas TPU kernel
  (interpreted) on its own pages under ``shard_map``."""
  rng = np.random.default_rng(5)
  G, Mm, P, N, K, H, S, NP, D, Q = 4, 2, 5, 4, 2, 8, 4, 4, 2, 2
  Pg = D * Q * (G // D * Mm * NP // Q + 2)
  length = rng.integers(1, NP * S + 1, (G, Mm))
  length[0, 0], length[1, 1] = 3, NP * S  # keys on sequence shard 0 only; every entry
  start = np.where(rng.random((G, Mm)) < 0.5, rng.integers(0, length), 0)
  need = np.arange(NP)[None, None, :] * S < length[..., None]
  table, _ = pages.allocate(jnp.full((G, Mm, NP), -1, jnp.int32),
                            jnp.zeros((D * Q, Pg // (D * Q)), jnp.int32), jnp.asarray(need), Q)
  table = np.asarray(table)
  Pl = Pg // (D * Q)
  for (g, m, e) in zip(*np.nonzero(need)):  # each entry on its own shard's pages
    assert table[g, m, e] // Pl == g // (G // D) * Q + e % Q
  pool_k, pool_v = rng.standard_normal((Pg, K, H, S)), rng.standard_normal((Pg, K, S, H))
  q = rng.standard_normal((G, Mm, N, H))
  pk, pv = rng.standard_normal((G, K, H, P)), rng.standard_normal((G, K, P, H))
  plen = rng.integers(1, P + 1, G)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  args = (f32(q), f32(pk), f32(pv), jnp.asarray(np.arange(P)[None, :] < plen[:, None]),
          f32(pool_k), f32(pool_v), jnp.asarray(table), jnp.asarray(start, jnp.int32),
          jnp.asarray(length, jnp.int32))
  attend = jax.jit(lambda *a: decode_lib.split_decode_attention(*a, shards=D, seq=Q))
  if on_mesh:
    kernel = pallas_kernels.paged_decode_attention
    monkeypatch.setattr(pallas_kernels, "paged_decode_attention",
                        functools.partial(kernel, interpret=True))
    mesh = sharding.make_mesh({"fsdp": 2, "sequence": 2, "tensor": 2})
    with sharding.use(mesh, "fsdp_tp"), pallas_kernels.target_platform("tpu"):
      assert "pallas_call" in str(jax.make_jaxpr(attend)(*args))
      got = attend(*args)
  else:
    got = attend(*args)
  want = _plain_attention(q, pk, pv, plen, pool_k, pool_v, table, start, length)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_live_bucket_is_a_power_of_two_of_pages():
  assert pages.live_bucket(1, 16, 512) == 8  # the 128-token floor
  assert pages.live_bucket(129, 16, 512) == 16
  assert pages.live_bucket(1000, 16, 512) == 64
  assert pages.live_bucket(8000, 16, 16) == 16  # at most every entry
  assert pages.live_bucket(3, 64, 2, floor_tokens=1) == 1


def test_the_engines_pool_rules_against_a_direct_count():
  """Both engines grow a pool by doubling up to the whole budget and reserve a page for a
  running sample whose next token's entry has none (pages.grown_size, next_token_pages)."""
  assert pages.grown_size(8, 2, 2, 64) == 8  # enough free: no growth
  assert pages.grown_size(8, 2, 3, 64) == 16 and pages.grown_size(8, 0, 20, 64) == 32
  assert pages.grown_size(8, 0, 500, 40) == 40  # at most the whole budget
  # two shards of 4 pages: each grows by half of what the pool grows by
  assert pages.grown_size(8, np.array([4, 0]), np.array([1, 1]), 64) == 16
  assert pages.grown_size(8, np.array([4, 0]), np.array([0, 5]), 64) == 32
  rng = np.random.default_rng(0)
  G, M, NP, S = 3, 4, 5, 4
  for _ in range(20):
    length = rng.integers(0, NP * S + 1, (G, M))
    table = np.where(rng.random((G, M, NP)) < 0.5, rng.integers(0, 50, (G, M, NP)), -1)
    run = rng.random((G, M)) < 0.7
    want = sum(1 for g in range(G) for m in range(M)
               if run[g, m] and table[g, m, min(max(length[g, m] - 1, 0) // S, NP - 1)] < 0)
    assert pages.next_token_pages(run, length, table, S) == want
    by_shard = [sum(1 for g in range(G) for m in range(M) if g == d
                    and run[g, m] and table[g, m, min(max(length[g, m] - 1, 0) // S, NP - 1)] < 0)
                for d in range(G)]  # one slot per shard
    np.testing.assert_array_equal(pages.next_token_pages(run, length, table, S, G), by_shard)
    # one slot shard of two sequence shards: entry e on shard e mod 2
    by_seq = [sum(1 for g in range(G) for m in range(M) if run[g, m]
                  and min(max(length[g, m] - 1, 0) // S, NP - 1) % 2 == q
                  and table[g, m, min(max(length[g, m] - 1, 0) // S, NP - 1)] < 0)
              for q in range(2)]
    np.testing.assert_array_equal(pages.next_token_pages(run, length, table, S, 1, 2), by_seq)
  assert [pages.spread(n, 4) for n in (0, 1, 4, 5, 9)] == [0, 1, 1, 2, 3]


@pytest.mark.parametrize("D,Q", [(1, 1), (2, 1), (2, 2)])
def test_page_bookkeeping_matches_python_reference_counts(D, Q):
  """Random takes, forks and releases on device against a Python count of the table entries
  naming each page: free pages (count 0) handed out lowest first per pool shard, entries in
  row-major order; the slots of slot shard d (``d·G/D ..``) take only pages of its shards,
  and with Q sequence shards entry e only of shard ``d·Q + e mod Q`` (pages
  ``(d·Q + e mod Q)·Pl ..``). A fork (from a sibling or from another slot of the same
  shard) names the source's whole pages, one more reference each, and takes a fresh page
  for the partial one; a holder that is no entry (``pages.hold``) counts as one; a page
  goes back to the pool when the last entry or holder lets it go."""
  G, Mm, NP, S = 4, 2, 4, 4
  Pg = 14 if Q == 1 else 16
  Pl = Pg // (D * Q)
  rng = np.random.default_rng(0)
  table, refs = jnp.full((G, Mm, NP), -1, jnp.int32), jnp.zeros((D * Q, Pl), jnp.int32)
  ref_table = -np.ones((G, Mm, NP), int)
  count = np.zeros(Pg, int)
  shard = lambda g, e: g // (G // D) * Q + e % Q
  of = np.vectorize(shard)(*np.meshgrid(np.arange(G), np.arange(Mm), np.arange(NP),
                                        indexing="ij")[::2])
  free_of = lambda d: [p for p in range(d * Pl, (d + 1) * Pl) if count[p] == 0]
  allocate = jax.jit(functools.partial(pages.allocate, seq=Q))
  release = jax.jit(pages.release)
  fork = jax.jit(functools.partial(pages.fork, S=S, seq=Q))
  hold = jax.jit(pages.hold, static_argnames="delta")
  pad = lambda ids: jnp.asarray(ids + [Pg] * (4 - len(ids)))  # Pg: padding, skipped
  forks, across, most, kept = 0, 0, 0, []
  for _ in range(100):
    u = rng.random()
    if u < 0.45:
      need = rng.random((G, Mm, NP)) < 0.3
      want = need & (ref_table < 0)
      if any(want[of == d].sum() > len(free_of(d)) for d in range(D * Q)):
        continue  # callers check capacity first
      table, refs = allocate(table, refs, jnp.asarray(need))
      ids = [free_of(d) for d in range(D * Q)]
      taken = [0] * (D * Q)
      for at in zip(*np.nonzero(want)):
        d = shard(at[0], at[2])
        ref_table[at] = ids[d][taken[d]]
        count[ids[d][taken[d]]] += 1
        taken[d] += 1
    elif u < 0.7:  # one fork onto an empty row, from a row whose first entries hold pages
      rows = [(g, m) for g in range(G) for m in range(Mm) if (ref_table[g, m] < 0).all()]
      srcs = [(g, m, int(np.argmin(np.append(ref_table[g, m] >= 0, False))))
              for g in range(G) for m in range(Mm)]
      pairs = [(d, s) for d in rows for s in srcs if s[2] > 0 and s[:2] != d
               and d[0] // (G // D) == s[0] // (G // D)]
      sibling = [(d, s) for d, s in pairs if s[0] == d[0]]
      pairs = sibling if sibling and rng.random() < 0.5 else pairs
      if not pairs:
        continue
      (g, m), (sg, sm, held) = pairs[rng.integers(len(pairs))]
      n = int(rng.integers(1, held * S + 1))
      e = (n - 1) // S  # the entry holding the cut
      if n % S and not free_of(shard(g, e)):
        continue
      table, refs, frm, to = fork(table, refs, *(jnp.asarray([x], jnp.int32)
                                                 for x in (g, sm, m, n, sg)[:4]),
                                  src_slot=jnp.asarray([sg], jnp.int32))
      for i in range(n // S):  # whole pages: shared
        ref_table[g, m, i] = ref_table[sg, sm, i]
        count[ref_table[g, m, i]] += 1
      if n % S:  # the partial page: a fresh one holding a copy
        fresh = free_of(shard(g, e))[0]
        ref_table[g, m, e] = fresh
        count[fresh] += 1
        assert (np.asarray(frm)[0, e], np.asarray(to)[0, e]) == (ref_table[sg, sm, e], fresh)
      forks, across = forks + 1, across + (sg != g)
    elif u < 0.85:  # a holder that is no table entry (a prefix cache) takes or drops pages
      if kept and rng.random() < 0.5:
        ids = kept.pop(0)
        refs = hold(refs, pad(ids), delta=-1)
        count[ids] -= 1
      else:
        ids = sorted(set(ref_table[ref_table >= 0].tolist()))[:3]
        refs = hold(refs, pad(ids), delta=1)
        count[ids] += 1
        kept.append(ids)
    else:
      rows = rng.random(G) < 0.5
      table, refs = release(table, refs, jnp.asarray(rows))
      for p in ref_table[rows][ref_table[rows] >= 0]:
        count[p] -= 1
      ref_table[rows] = -1
    np.testing.assert_array_equal(np.asarray(table), ref_table)
    np.testing.assert_array_equal(np.asarray(refs).reshape(-1), count)
    most = max(most, count.max())
  assert forks - across >= 2 and across >= 2 and most >= 2
  # one entry per sample, as the decode step takes them
  take = jnp.asarray([[True, False], [True, True], [False, True], [True, False]])
  table = jnp.full((G, Mm, NP), -1, jnp.int32).at[1, 0, 2].set(5)
  refs = jnp.zeros(Pg, jnp.int32).at[5].set(1).reshape(D * Q, Pl)
  t2, r2, page = pages.take_entry(table, refs, take, jnp.full((G, Mm), 2), Q)
  want = {(1, 1): [[0, -1], [5, 1], [-1, 2], [3, -1]],
          (2, 1): [[0, -1], [5, 1], [-1, 7], [8, -1]],
          (2, 2): [[0, -1], [5, 1], [-1, 8], [9, -1]]}[D, Q]  # entry 2: sequence shard 0
  np.testing.assert_array_equal(np.asarray(page), want)
  assert np.asarray(t2)[2, 1, 2] == want[2][1] and np.asarray(r2).reshape(-1)[want[2][1]] == 1


def test_paged_bad_inputs_raise_one_clear_error():
  for bad in (0, 3, 48, -4, 2.0):
    with pytest.raises(rollout.RolloutError, match="page_size must be a positive power of two"):
      _gen(page_size=bad)
  with pytest.raises(rollout.RolloutError, match="smaller than one group needs"):
    _gen(page_size=4, kv_pages=M * MAX_NEW // 4 - 1)
  with pytest.raises(rollout.RolloutError, match="kv_pages must be an integer >= 1"):
    _gen(page_size=4, kv_pages=0)
  with pytest.raises(rollout.RolloutError, match="exceeds the context"):
    _gen(max_new_tokens=CFG.max_position_embeddings)
  for bad, needle in (([[1]] * 2, "one token-id list per prompt"),
                      ([[1]] * 5 + [[CFG.vocab_size]], "outside the vocabulary"),
                      ([[1]] * 5 + [["a"]], "prefix 5 must be a sequence of integer token ids"),
                      ([[1]] * 5 + [[0.5]], "prefix 5 has token id 0.5, which is not an"),
                      ([[1]] * 5 + [[1] * MAX_NEW], "leaves no room")):
    with pytest.raises(rollout.RolloutError, match=needle):
      _gen(prefixes=bad)
  for bad in (0, 6, 2.0):
    with pytest.raises(rollout.RolloutError,
                       match="prefill_chunk must be a positive power of two"):
      _gen(prefill_chunk=bad)


def test_prompts_prefilled_in_chunks_give_the_whole_prompts_tokens(reference):
  """Prompts of 1..6 tokens (bucket 8) prefilled 2 or 4 tokens at a time (each chunk
  attending the K/V of the chunks before it, ``prefill.prefill_prompts``) sample the tokens
  of the whole-prompt prefill, log-probs to float rounding; a 40-token prompt in 8 chunks
  of 8 too."""
  for chunk in (2, 4):
    for t in (0.0, 1.0):
      _same(_gen(temperature=t, page_size=MAX_NEW, prefill_chunk=chunk), reference[t])
  long = [PROMPTS[0] + [(5 * j) % 60 + 1 for j in range(39)]]
  whole, chunked = (_gen(long, prefill_chunk=c) for c in (None, 8))
  _same(chunked, whole)


def test_a_fork_shares_whole_pages_and_copies_the_partial_one():
  """``pages.fork`` against the definition: entries wholly below the cached length name the
  source's pages, the one holding the cut gets a fresh page holding a copy, later ones none;
  with an identity table every kept page is copied onto the sample's own; on a pool of two
  shards the fresh page is one of the slot's shard."""
  G, Ms, NP, S = 2, 3, 4, 4
  fork = jax.jit(pages.fork, static_argnames=("S", "identity"))  # one program per call
  rng = np.random.default_rng(0)
  table = np.full((G, Ms, NP), -1, np.int32)
  table[1, 0] = [5, 2, 7, -1]
  refs = np.zeros(12, np.int32)
  refs[[5, 2, 7]] = 1
  slot, src, dst, cached = (np.array(x, np.int32) for x in ([1, 1, 2], [0, 0, 0], [1, 2, 0],
                                                            [6, 8, 3]))
  t, f, frm, to = fork(jnp.asarray(table), jnp.asarray(refs)[None], slot, src, dst, cached, S)
  t, f, frm, to = map(np.asarray, (t, f, frm, to))
  f = f.ravel()
  assert t[1, 1].tolist() == [5, 0, -1, -1]  # 6 cached: page 5 shared, 2's copy on page 0
  assert t[1, 2].tolist() == [5, 2, -1, -1]  # 8 cached: two whole pages, nothing copied
  assert (t[0] == -1).all() and (t[1, 0] == table[1, 0]).all()  # row 3 is padding
  assert [(a, b) for a, b in zip(frm.ravel(), to.ravel()) if a < 12] == [(2, 0)]
  # references: page 5 named by three rows, 2 by two, 7 and the copy 0 by one
  assert f.tolist() == [{5: 3, 2: 2, 7: 1, 0: 1}.get(i, 0) for i in range(12)]
  pool = (jnp.asarray(rng.normal(size=(12, 2, 3, S)), jnp.float32),)
  moved = np.asarray(pages.copy_pages(pool, jnp.asarray(frm), jnp.asarray(to))[0])
  np.testing.assert_array_equal(moved[0], np.asarray(pool[0])[2])
  np.testing.assert_array_equal(np.delete(moved, 0, 0), np.delete(np.asarray(pool[0]), 0, 0))
  # two shards of 6 pages: slot 1's fresh page is shard 1's lowest free one (6)
  split = np.where(table >= 0, [[[11, 8, 7, -1]]], -1).astype(np.int32)
  refs = np.zeros((2, 6), np.int32)
  refs[1, [1, 2, 5]] = 1
  t, f, frm, _ = fork(jnp.asarray(split), jnp.asarray(refs), slot[:1], src[:1], dst[:1],
                      cached[:1], S)
  assert np.asarray(t)[1, 1].tolist() == [11, 6, -1, -1] and np.asarray(f)[1].tolist() == [
      1, 1, 1, 0, 0, 2]
  assert not np.asarray(f)[0].any() and np.asarray(frm)[0].tolist()[:2] == [12, 8]
  ident = np.asarray(pages.identity_table(G, Ms, NP))
  *_, frm, to = fork(jnp.asarray(ident), jnp.ones((1, G * Ms * NP), jnp.int32), slot[:1],
                     src[:1], dst[:1], cached[:1], S, identity=True)
  assert [(a, b) for a, b in zip(np.ravel(frm), np.ravel(to)) if a < G * Ms * NP] == [
      (ident[1, 0, 0], ident[1, 1, 0]), (ident[1, 0, 1], ident[1, 1, 1])]


@pytest.mark.parametrize("page_size,kv_pages", [(4, None), (4, 8 * M * MAX_NEW // 4),
                                                (2, M * MAX_NEW // 2)])
def test_samples_continuing_one_prefix_fork_it_and_sample_as_if_prefilled(page_size, kv_pages):
  """n samples continuing a response prefix per prompt (a mid-sequence state): the prefix is
  prefilled once and the other samples fork it; tokens and log-probs equal those of every
  sample prefilling it (in-place pages, a fixed pool, a preempting pool), and the
  continuations' log-probs equal teacher forcing."""
  rng = np.random.default_rng(1)
  ok = [t for t in range(1, CFG.vocab_size) if t not in EOS]
  heads = [rng.choice(ok, size=n).tolist() for n in (5, 8, 9, 0, 13, 1)]
  kw = dict(temperature=0.9, page_size=page_size, kv_pages=kv_pages, prefixes=heads)
  forked, plain = _gen(**kw), _gen(share_prefixes=False, **kw)
  _same(forked, plain)
  assert plain.stats["forked_samples"] == 0
  want = ((M - 1) * 4, (M - 1) * (4 + 7 + 8 + 12))  # the first admission's forks
  got = (forked.stats["forked_samples"], forked.stats["fork_tokens_shared"])
  if kv_pages == M * MAX_NEW // 2:  # preempted groups fork again when they resume: more
    assert forked.stats["preemptions"] > 0 and got[0] >= want[0] and got[1] >= want[1], got
  else:
    assert got == want
  for r in range(len(PROMPTS) * M):
    head = heads[r // M]
    assert forked.tokens[r, :len(head)].tolist() == head
    assert (forked.versions[r, :len(head)] == -1).all()
  rows = [PROMPTS[r // M] for r in range(len(PROMPTS) * M)]
  z = _teacher_forced_logits(CFG, PARAMS, rows, forked.tokens) / 0.9
  ref = np.take_along_axis(z - scipy.special.logsumexp(z, axis=-1, keepdims=True),
                           forked.tokens[..., None], axis=-1)[..., 0]
  new = forked.mask & (forked.versions >= 0)
  np.testing.assert_allclose(np.where(new, forked.logprobs, 0), np.where(new, ref, 0),
                             atol=1e-5, rtol=0)


@pytest.mark.parametrize("share", [False, True])
def test_a_growing_pool_makes_room_for_long_resumed_samples_before_rebuilding_them(share):
  """Samples resumed with more tokens than a growing pool's first size holds (there: room
  for 256 tokens a sample): the pool grows before their K/V is rebuilt, so nothing is
  dropped; the continuations' log-probs equal teacher forcing."""
  rng = np.random.default_rng(2)
  ok = [t for t in range(1, CFG.vocab_size) if t not in EOS]
  prompts = PROMPTS[:2]
  heads = [rng.choice(ok, size=700).tolist() for _ in prompts]
  out = rollout.generate(CFG, PARAMS, prompts, n=2, max_new_tokens=720, temperature=0.9,
                         eos_id=EOS, seed=3, prefixes=heads, share_prefixes=share)
  rows = [prompts[r // 2] for r in range(4)]
  z = _teacher_forced_logits(CFG, PARAMS, rows, out.tokens) / 0.9
  ref = np.take_along_axis(z - scipy.special.logsumexp(z, axis=-1, keepdims=True),
                           out.tokens[..., None], axis=-1)[..., 0]
  new = out.mask & (out.versions >= 0)
  assert new.sum() >= 4
  np.testing.assert_allclose(np.where(new, out.logprobs, 0), np.where(new, ref, 0),
                             atol=1e-5, rtol=0)
