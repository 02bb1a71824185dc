"""Engine: continuous batching and active partial rollouts (APRIL) against plain generate."""

import itertools
import math
import types

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest

from rl_jax import models, rollout

# One model and one set of engine shapes for the whole file (n=2, 2 slots, prompt bucket 8,
# response bucket 16), so the jitted pieces compile once.
CFG = models.ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
PARAMS = models.init_params(CFG, jax.random.key(0), std=0.2)
M, MAX_NEW = 2, 16
EOS = list(range(3, 61, 5))  # 12 EOS ids: per-sample lengths spread over 1..MAX_NEW
PROMPTS = [[(7 * i + j) % 60 + 1 for j in range(1 + i % 6)] for i in range(8)]


def _engine(seed=5, eos=EOS, k_slots=2, **kw):
  return rollout.RolloutEngine(CFG, n=M, max_slots=k_slots, max_new_tokens=MAX_NEW,
                               max_prompt_len=8, temperature=1.0, eos_id=eos, seed=seed, **kw)


def _reference(prompts, seed=5, eos=EOS):
  return rollout.generate(CFG, PARAMS, prompts, n=M, max_new_tokens=MAX_NEW, temperature=1.0,
                          eos_id=eos, seed=seed)


def test_continuous_batching_equals_one_batch():
  ref = _reference(PROMPTS)
  assert len(set(ref.lengths.tolist())) > 2  # a spread of lengths, so slots free at different times
  out = rollout.generate(CFG, PARAMS, PROMPTS, n=M, max_new_tokens=MAX_NEW, temperature=1.0,
                         eos_id=EOS, seed=5, max_slots=2)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.mask, ref.mask)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
  np.testing.assert_array_equal(out.finish_reason, ref.finish_reason)


@pytest.mark.parametrize("prompt_pages", [False, True])
def test_april_returns_k_groups_and_resumes_exactly(prompt_pages):
  """With fixed weights a resumed sample continues exactly as if never interrupted; with the
  prompts on pages of 4 (``prompt_pages``) too, their ids cut off the returned rows."""
  eng = _engine(prompt_pages=prompt_pages, page_size=4 if prompt_pages else 64)
  it = iter(PROMPTS)
  groups, resumed = {}, 0
  for step in range(6):
    out = eng.rollout_groups(PARAMS, it, k_groups=1, policy_version=step)
    assert out.tokens.shape == (M, MAX_NEW) and len(out.group_ids) == 1
    resumed += out.stats["resumed_groups"]
    groups[int(out.group_ids[0])] = out
    assert ((out.versions >= 0) == out.mask).all()
    assert (np.diff(np.where(out.mask, out.versions, step), axis=1) >= 0).all()
  assert resumed > 0, "no group was aborted and resumed; the test would not exercise APRIL"
  pulled = max(groups) + 1
  ref = _reference(PROMPTS[:max(pulled, len(PROMPTS))])
  for uid, out in groups.items():
    rows = slice(uid * M, uid * M + M)
    np.testing.assert_array_equal(out.tokens, ref.tokens[rows])
    np.testing.assert_array_equal(out.mask, ref.mask[rows])
    np.testing.assert_allclose(out.logprobs, ref.logprobs[rows], atol=1e-5)
    assert out.prompts == [PROMPTS[uid]]


def _counting(prompts, counter):
  for p in prompts:
    counter[0] += 1
    yield p


@hypothesis.settings(max_examples=6, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(seed=st.integers(0, 10_000), k=st.integers(1, 3),
                  n_eos=st.integers(9, 16), steps=st.integers(2, 4))
def test_april_bookkeeping_property(seed, k, n_eos, steps):
  eos = list(range(2, 60, 3))[:n_eos]
  eng = _engine(seed=seed, eos=eos)
  pulled = [0]
  prompts = _counting((PROMPTS[i % len(PROMPTS)] for i in itertools.count()), pulled)
  seen: set[int] = set()
  snapshot: dict[int, list] = {}
  in_flight = math.ceil(2.0 * k)
  for step in range(steps):
    buffer_before = [r.uid for r in eng.buffer]
    ready_before = len(eng.ready)
    pulled_before = pulled[0]
    out = eng.rollout_groups(PARAMS, prompts, k_groups=k, policy_version=step)
    # exactly K complete groups, prompt-major, no duplicates across steps
    assert out.tokens.shape == (k * M, MAX_NEW)
    ids = out.group_ids.tolist()
    assert len(set(ids)) == k and not seen & set(ids)
    seen |= set(ids)
    np.testing.assert_array_equal(out.prompt_index, np.repeat(np.arange(k), M))
    # buffered groups are served before any new prompt is pulled
    room = in_flight - ready_before if ready_before < k else 0
    assert pulled[0] - pulled_before == max(0, room - len(buffer_before))
    # FIFO: buffered groups not returned stay at the front, in order
    ready_now = {r.uid for r in eng.ready}
    left = [u for u in buffer_before[:room] if u not in ids and u not in ready_now]
    assert [r.uid for r in eng.buffer][:len(left)] == left
    # token, log-prob and version arrays stay aligned
    assert (out.mask == (np.arange(MAX_NEW)[None] < out.lengths[:, None])).all()
    assert ((out.versions >= 0) == out.mask).all() and (out.versions <= step).all()
    assert (out.logprobs[~out.mask] == 0).all() and (out.logprobs[out.mask] <= 0).all()
    assert (out.tokens[~out.mask] == 0).all()
    for b in range(k * M):
      L = out.lengths[b]
      assert out.finish_reason[b] in ("eos", "length")
      assert (out.finish_reason[b] == "eos") == (out.tokens[b, L - 1] in eos)
      # a resumed sample keeps the tokens, log-probs and versions it had when aborted
      uid, i = ids[b // M], b % M
      if uid in snapshot:
        toks, lps, vers = snapshot[uid][i]
        assert out.tokens[b, :len(toks)].tolist() == toks
        np.testing.assert_array_equal(out.logprobs[b, :len(lps)], np.float32(lps))
        assert out.versions[b, :len(vers)].tolist() == vers
    # nothing lost: every pulled prompt is returned, buffered or ready, exactly once
    held = [r.uid for r in eng.buffer] + [r.uid for r in eng.ready]
    assert len(held) == len(set(held)) and not set(held) & seen
    assert len(seen) + len(held) == pulled[0]
    for r in eng.buffer:
      assert len(r.samples) == M
      snapshot[r.uid] = [(s.tokens, s.logprobs, s.versions) for s in r.samples]
      for s in r.samples:
        assert len(s.tokens) == len(s.logprobs) == len(s.versions) <= MAX_NEW


def test_staleness_bound_zero_is_synchronous():
  sync, wait = _engine(max_staleness=0), _engine(over_sampling=1.0)
  it_sync, it_wait = iter(PROMPTS), iter(PROMPTS)
  for step in range(3):
    a = sync.rollout_groups(PARAMS, it_sync, k_groups=2, policy_version=step)
    b = wait.rollout_groups(PARAMS, it_wait, k_groups=2, policy_version=step)
    assert a.stats["aborted_groups"] == 0 and a.stats["max_token_lag"] == 0
    assert (a.versions[a.mask] == step).all() and not sync.buffer
    np.testing.assert_array_equal(a.group_ids, b.group_ids)
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_staleness_bound_restarts_stale_samples():
  eta = 1
  eng = _engine(max_staleness=eta, over_sampling=3.0)
  prompts = (PROMPTS[i % len(PROMPTS)] for i in itertools.count())
  restarted = 0
  for step in range(10):
    out = eng.rollout_groups(PARAMS, prompts, k_groups=1, policy_version=step)
    assert out.tokens.shape == (M, MAX_NEW)
    assert ((step - out.versions)[out.mask] <= eta).all()
    assert out.stats["max_token_lag"] <= eta
    # in flight capped at (η+1)·K = 2 (3 without the cap), one returned: at most η held
    assert len(eng.buffer) + len(eng.ready) <= eta
    restarted += out.stats["restarted_samples"]
  assert restarted > 0, "no sample outlived the bound; the test would not exercise it"


def test_the_warmup_buckets_are_every_bucket_a_call_can_take():
  """Both engines warm up slots.buckets and slots.resume_shapes: every admission / prompt /
  extension bucket (min(top, pow2(n, lo))) and every re-prefill bucket a call can meet."""
  from rl_jax.rollout import slots  # pylint: disable=g-import-not-at-top
  from rl_jax.rollout.records import pow2  # pylint: disable=g-import-not-at-top
  for lo in (4, 8, 16):
    for top in range(1, 130):
      assert slots.buckets(lo, top) == sorted({min(top, pow2(n, lo)) for n in range(1, top + 1)})
  for G, M, R, C in itertools.product((1, 3, 8), (1, 4), (8, 64, 256), (None, 4, 32)):
    # a re-prefill call computes at most ``prefill_chunk`` (C) positions of a row
    # and at most G x min(P, C) positions a call, or 4 rows (``slots.call_fits``), P = 16
    every = {slots.resume_shape(rows, n, G=G, M=M, R=R, chunk=C)
             for rows in range(1, G * M + 1) for n in range(1, min(R, C or R) + 1)}
    every = {(Br, T) for Br, T in every if C is None or Br * T <= G * min(16, C) or Br <= 4}
    assert slots.resume_shapes(G=G, M=M, R=R, P=16, chunk=C) == sorted(every)
    assert max(T for _, T in every) == min(R, C or R)


def test_tail_rounds_cut_each_row_into_consecutive_chunks():
  """``slots.tail_rounds``: round i holds the i-th piece of every row long enough to have
  one; a row's pieces, in round order, cover its positions start .. n once each, every one
  at most the chunk long (a whole piece without a chunk)."""
  from rl_jax.rollout import slots  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  for chunk in (None, 1, 4, 16):
    tails = []
    for i in range(12):
      k = int(rng.integers(0, 30))
      tails.append((i % 5, i, 7 - i % 3, k + int(rng.integers(1, 60)), k))
    rounds = slots.tail_rounds(tails, chunk)
    for b, m, g, n, k in tails:
      pieces = [p for r in rounds for p in r if p[:3] == (b, m, g)]
      assert [p[4] for p in pieces] == list(range(k, n, chunk or n - k))
      assert [p[3] for p in pieces] == [min(n, s + (chunk or n - k)) for _, _, _, _, s in pieces]
      assert all(p in rounds[i] for i, p in enumerate(pieces))
    assert sum(len(r) for r in rounds) == sum(-(-(n - k) // (chunk or n - k))
                                             for *_, n, k in tails)


def test_resume_calls_cut_the_rows_where_the_fewest_tokens_are_computed():
  """``slots.resume_calls``: every row in exactly one call, each call a ``resume_shape``
  bucket that holds its rows and their longest length, and the total Br·T the least of
  every way to cut the rows, longest first, into consecutive calls (enumerated here)."""
  from rl_jax.rollout import slots  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  for trial in range(60):
    G, M, R = [(2, 4, 64), (8, 8, 4096), (4, 2, 512)][trial % 3]
    # ``prefill_chunk``: rows of at most C positions, calls of at most G x min(P, C)
    # positions (or 4 rows), P the prompt bucket
    C, P = [None, R // 8, R // 2][trial // 3 % 3], [8, 64][trial // 9 % 2]
    n = int(rng.integers(1, 9 if C is None else 17))
    lengths = [int(x) for x in np.minimum(rng.geometric(4 / R, n), C or R)]
    calls = slots.resume_calls(lengths, G=G, M=M, R=R, P=P, chunk=C)
    assert sorted(i for rows, _ in calls for i in rows) == list(range(n))
    for rows, (Br, T) in calls:
      assert (Br, T) == slots.resume_shape(len(rows), max(lengths[i] for i in rows),
                                           G=G, M=M, R=R, chunk=C)
      assert C is None or Br * T <= G * min(P, C) or Br <= 4
    ordered = sorted(lengths, reverse=True)
    shape = lambda a, b: slots.resume_shape(b - a, ordered[a], G=G, M=M, R=R, chunk=C)
    fits = lambda Br, T: C is None or Br * T <= G * min(P, C) or Br <= 4
    best = min(
        sum(math.prod(shape(a, b)) for a, b in zip((0,) + cuts, cuts + (n,)))
        for k in range(n) for cuts in itertools.combinations(range(1, n), k)
        if all(fits(*shape(a, b)) and shape(a, b)[0] >= b - a
               for a, b in zip((0,) + cuts, cuts + (n,))))
    assert sum(Br * T for _, (Br, T) in calls) == best
  # two long rows no longer pad six short ones to their length (one call: 16 x 2048)
  assert slots.resume_calls([2047, 36, 50, 1162, 62, 76, 171, 89], G=8, M=8, R=4096) == [
      ([0, 3, 6, 7], (4, 2048)), ([5, 4, 2, 1], (4, 1024))]


def test_warmup_compiles_every_shape_up_front():
  from rl_jax.rollout import sampler
  eng = _engine(max_staleness=2)
  eng.warmup(PARAMS)
  assert eng.warmup(PARAMS) == 0  # everything already compiled
  before = dict(sampler.TRACE_COUNTS)
  prompts = (PROMPTS[i % len(PROMPTS)] for i in itertools.count())
  resumed = 0
  for step in range(8):
    out = eng.rollout_groups(PARAMS, prompts, k_groups=1, policy_version=step)
    resumed += out.stats["resumed_groups"]
  assert resumed > 0 and dict(sampler.TRACE_COUNTS) == before


def test_held_groups_survive_export_and_import():
  """An engine rebuilt from ``export_held`` continues exactly like the original."""
  tagged = [rollout.Prompt(PROMPTS[i % len(PROMPTS)], meta=i) for i in range(40)]
  a, pulled = _engine(max_staleness=2), [0]
  it_a = _counting(tagged, pulled)
  for step in range(3):
    a.rollout_groups(PARAMS, it_a, k_groups=1, policy_version=step)
  held = a.export_held(capacity=4)
  assert held["valid"].any(), "nothing held; the test would not exercise the round trip"
  b = _engine(max_staleness=2)
  b.import_held(held)
  it_b = iter(tagged[pulled[0]:])
  for step in range(3, 6):
    out_a = a.rollout_groups(PARAMS, it_a, k_groups=1, policy_version=step)
    out_b = b.rollout_groups(PARAMS, it_b, k_groups=1, policy_version=step)
    np.testing.assert_array_equal(out_a.group_ids, out_b.group_ids)
    np.testing.assert_array_equal(out_a.tokens, out_b.tokens)
    np.testing.assert_array_equal(out_a.versions, out_b.versions)
    np.testing.assert_allclose(out_a.logprobs, out_b.logprobs, atol=1e-6)
    assert out_a.group_meta == out_b.group_meta
    assert [tagged[m].tokens for m in out_a.group_meta] == out_a.prompts
  c = _engine()
  c.import_held(held)
  with pytest.raises(rollout.RolloutError, match="capacity"):
    c.export_held(capacity=int(held["valid"].sum()) - 1)


def test_engine_bad_inputs():
  with pytest.raises(rollout.RolloutError, match="max_staleness"):
    _engine(max_staleness=-1)
  with pytest.raises(rollout.RolloutError, match="k_groups"):
    _engine().rollout_groups(PARAMS, iter(PROMPTS), k_groups=0)
  with pytest.raises(rollout.RolloutError, match="over_sampling"):
    _engine(over_sampling=0.5)
  with pytest.raises(rollout.RolloutError, match="max_prompt_len"):
    _engine().rollout_groups(PARAMS, iter([[1] * 9]), k_groups=1)
  with pytest.raises(rollout.RolloutError, match="exceeds the context"):
    rollout.RolloutEngine(CFG, max_prompt_len=60, max_new_tokens=8)


def test_params_in_another_dtype_are_cast_without_recompiling():
  from rl_jax.rollout import sampler
  eng = _engine()
  half = jax.tree.map(lambda x: x.astype("bfloat16"), PARAMS)
  assert {x.dtype for x in jax.tree.leaves(eng.prepare_params(half))} == {np.dtype("float32")}
  out = eng.rollout_groups(half, iter(PROMPTS), k_groups=1)
  before = dict(sampler.TRACE_COUNTS)
  eng.rollout_groups(jax.tree.map(lambda x: x * 1.01, half), iter(PROMPTS), k_groups=1)
  assert dict(sampler.TRACE_COUNTS) == before
  assert out.tokens.shape == (M, MAX_NEW)


def test_online_calls_submit_stream_and_abort_while_others_decode():
  """The loop's online calls on a live batch: submitted groups join it, a running group's
  tokens grow a few decode steps at a time (each read a prefix of its final response), an
  aborted group's pages return to the pool at once, a group submitted while others decode
  takes the freed slot, and the others' responses are what one ``generate`` call gives (each
  sample draws from its own stream, whatever it is batched with)."""
  ref = _reference(PROMPTS[:3], eos=None)
  e = _engine(eos=None, page_size=4, kv_pages=12)  # a fixed pool: pages change hands
  loop = rollout.Loop(e, e.prepare_params(PARAMS), 0)
  loop.chunk_steps = 3  # decode steps per ``step`` while nothing else is due
  a, b, c = [e.groups_of(e.new_request(p, i))[0] for i, p in enumerate(PROMPTS[:3])]
  loop.submit([a, b])
  loop.step()
  first = loop.running_tokens([a, b, c])
  assert set(first) == {id(a), id(b)}  # c was not submitted
  loop.step()
  second = loop.running_tokens([a, b])
  for g, grp in enumerate((a, b)):
    for m in range(M):
      ids, lps = second[id(grp)][m]
      assert len(first[id(grp)][m][0]) < len(ids) < MAX_NEW
      assert first[id(grp)][m][0] == ids[:len(first[id(grp)][m][0])]
      np.testing.assert_array_equal(ids, ref.tokens[g * M + m, :len(ids)])
      np.testing.assert_allclose(lps, ref.logprobs[g * M + m, :len(ids)], atol=1e-5)
  held = int((np.asarray(loop.state.pages)[a.slot] >= 0).sum())
  free = int((np.asarray(loop.state.refs) == 0).sum())
  loop.abort(a)
  assert a.done and a.slot is None and held > 0
  assert int((np.asarray(loop.state.refs) == 0).sum()) == free + held
  loop.submit([c])
  while not (b.done and c.done):
    loop.step()
  assert loop.running_tokens([a, b, c]) == {}
  loop.step()  # an idle loop between requests does nothing
  for g, grp in ((1, b), (2, c)):
    for m, t in enumerate(grp.trajs):
      np.testing.assert_array_equal(t.tokens, ref.tokens[g * M + m])
      np.testing.assert_allclose(t.logprobs, ref.logprobs[g * M + m], atol=1e-5)


def _on_pages(uid, prompt, new):
  """A one-sample group whose prompt after its first id opens its sample as ids it did not
  sample, written onto its pages at admission (the server's prompt-pages choices)."""
  from rl_jax.rollout.agent_records import Trajectory
  from rl_jax.rollout.loop import Group
  rest = list(prompt[1:])
  t = Trajectory(None, [], rest, [0.0] * len(rest), [-1] * len(rest), [False] * len(rest),
                 [0] * len(rest))
  grp = Group(uid, list(prompt[:1]), [t], None)
  grp.max_turn, grp.budget = new, [len(rest) + new]
  return grp


def test_groups_with_one_prompt_share_its_pages_across_slots():
  """Prompts on pages (one sample per slot): a group admitted while another with its prompt
  decodes forks that one's whole prompt pages (one more reference each) instead of
  prefilling them, and a group whose prompt begins with 14 of its ids forks the 3 whole
  pages they share and prefills the rest (``extend.prefill_tail``); the first group aborted,
  the shared pages stay with the others, whose tokens (while a third group takes the freed
  pages) equal those of a loop that shares nothing, log-probs to float rounding. Two groups
  admitted together share too."""
  prompt = [(5 * j) % 60 + 1 for j in range(23)]  # 22 ids after the first: 5 pages of 4
  other = [(3 * j) % 60 + 1 for j in range(23)]
  begins = prompt[:15] + [9] * 8  # 14 ids after the first in common: 3 whole pages

  def run(share):
    e = rollout.RolloutEngine(CFG, n=1, max_slots=4, max_new_tokens=40, max_prompt_len=1,
                              temperature=1.0, eos_id=None, seed=5, page_size=4,
                              kv_pages=32, share_prefixes=share)
    loop = rollout.Loop(e, e.prepare_params(PARAMS), 0)
    loop.chunk_steps = 3
    a, b, h = _on_pages(0, prompt, 16), _on_pages(1, prompt, 16), _on_pages(5, begins, 12)
    c = _on_pages(2, other, 16)
    loop.submit([a])
    loop.step()
    loop.submit([b, h])
    loop.step()  # b and h join while a decodes
    shared = np.asarray(loop.state.pages)[b.slot, 0, :5]
    refs = np.asarray(loop.state.refs).reshape(-1)[shared]
    loop.abort(a)
    after = np.asarray(loop.state.refs).reshape(-1)[shared]
    loop.submit([c])
    while not (b.done and c.done and h.done):
      loop.step()
    d, f = _on_pages(3, other, 8), _on_pages(4, other, 8)
    loop.submit([d, f])  # admitted together
    while not (d.done and f.done):
      loop.step()
    return loop, (b, h, c, d, f), refs, after

  loop, groups, refs, after = run(True)
  base, plain, *_ = run(False)
  assert loop.stats["forked_samples"] == 3 and base.stats["forked_samples"] == 0
  assert loop.stats["fork_tokens_shared"] == 21 + 12 + 21  # b and f whole; h 3 pages
  assert base.stats["reprefill_tokens"] - loop.stats["reprefill_tokens"] == 21 + 12 + 21
  assert refs.tolist() == [3, 3, 3, 2, 2] and after.tolist() == [2, 2, 2, 1, 1]
  assert loop.used[1] == base.used[1] - 5 - 3  # after b and h joined
  for grp, ref in zip(groups, plain):
    t, r = grp.trajs[0], ref.trajs[0]
    assert len(t.tokens) > 22
    np.testing.assert_array_equal(t.tokens, r.tokens)
    np.testing.assert_allclose(t.logprobs, r.logprobs, atol=1e-5)


def test_fork_sources_are_same_prompt_samples_of_the_slots_pool_shard():
  """``slots.forks`` on a hand-made admission of 4 groups (slots 0-3, two pool shards of two
  slots): a sibling covering a sample's tokens is its source first, then a sample of
  another group with its prompt on its shard (admitted with it, or resident); a group with
  another prompt or on the other shard is not a source; with a page size, a sample that
  only begins like a source forks the whole pages in common and re-prefills the rest."""
  a = rollout.slots.admission_rows(4, 4, G=4, M=2, R=16, budget=16)
  a["slots"][:] = [0, 1, 2, 3]
  a["prompt"][:, :2] = [[1, 2], [1, 2], [1, 2], [1, 3]]
  a["prompt_len"][:] = 2
  base = np.arange(10, 22)
  a["tokens"][0, 0, :12] = base  # group 0: two samples, one continuing the other
  a["tokens"][0, 1, :8] = base[:8]
  a["tokens"][1, 0, :9] = base[:9]  # group 1, the same prompt on shard 0
  a["tokens"][2, 0, :9] = base[:9]  # group 2, the same prompt on shard 1
  a["tokens"][3, 0, :9] = base[:9]  # group 3, another prompt
  a["tokens"][1, 1, :10] = np.r_[base[:6], [99] * 4]  # begins like group 0's for 6 tokens
  resume = [(0, 0, 0, 12), (0, 1, 0, 8), (1, 0, 1, 9), (1, 1, 1, 10), (2, 0, 2, 9),
            (3, 0, 3, 9)]
  shard = np.array([0, 0, 1, 1])
  kept, out, tails = rollout.slots.forks(a, resume)
  assert kept == [(0, 0, 0, 12), (1, 1, 1, 10), (1, 0, 1, 9), (2, 0, 2, 9), (3, 0, 3, 9)]
  assert out == [(0, 0, 1, 8, 0)] and tails == []  # within the group only
  kept, out, tails = rollout.slots.forks(a, resume, shard, page=4)
  assert kept == [(0, 0, 0, 12), (2, 0, 2, 9), (3, 0, 3, 9)]
  assert out == [(0, 0, 1, 8, 0), (1, 0, 1, 4, 0), (1, 0, 0, 9, 0)]
  assert tails == [(1, 1, 1, 10, 4)]  # 6 tokens in common: one whole page of 4
  # slot 3's sample decodes (shard 1); rows 2 and 3, with its prompt, come into slots 2
  # (shard 1: forks it) and 0 (shard 0: re-prefilled)
  resident = [(3, 0, (1, 2), base[:12], 1)]
  a["slots"][:] = [1, 3, 2, 0]
  a["prompt"][3, :2] = [1, 2]
  kept, out, tails = rollout.slots.forks(a, [(2, 0, 2, 9), (3, 0, 0, 9)], shard, resident, 4)
  assert out == [(2, 0, 0, 9, 3)] and kept == [(3, 0, 0, 9)] and tails == []


def _forks_by_scanning(a, resume, shard=None, resident=(), page=None):
  """``slots.forks`` as a scan of every source for every sample (the reference)."""
  prompt = lambda b: tuple(a["prompt"][b, :a["prompt_len"][b]].tolist())
  kept, out, tails = [], [], []
  for b, m, g, n in sorted(resume, key=lambda r: (r[0], -r[3], r[1])):
    row = a["tokens"][b, m, :n]
    sources = [(sg, sm, a["tokens"][sb, sm, :sn]) for sb, sm, sg, sn in kept if sb == b]
    if shard is not None:
      sources += [(sg, sm, a["tokens"][sb, sm, :sn]) for sb, sm, sg, sn in kept if sb != b
                  and shard[sg] == shard[g] and prompt(sb) == prompt(b)]
      sources += [(sg, sm, np.asarray(ids)) for sg, sm, p, ids, d in resident
                  if d == shard[g] and tuple(p) == prompt(b)]
    src = next(((sg, sm) for sg, sm, ids in sources
                if len(ids) >= n and np.array_equal(ids[:n], row)), None)
    if src is not None:
      out.append((g, src[1], m, n, src[0]))
      continue
    common = [(rollout.slots.common_prefix(ids, row) // page * page if page else 0, sg, sm)
              for sg, sm, ids in sources]
    best = max(common, default=(0, 0, 0), key=lambda c: c[0])
    if best[0] > 0:
      out.append((g, best[2], m, best[0], best[1]))
      tails.append((b, m, g, n, best[0]))
    else:
      kept.append((b, m, g, n))
  return kept, out, tails


@pytest.mark.parametrize("seed", range(6))
def test_fork_sources_found_by_their_first_ids_equal_a_scan_of_every_source(seed):
  """``slots.forks`` looks sources up by scope and first ids; on random admissions (prompts
  and continuations drawn from a few shared stems, so that whole, partial and no matches
  all occur, with residents; every fourth row a fresh group's equal samples) it picks what
  a scan of every source picks, in order."""
  rng = np.random.default_rng(seed)
  G, M, R = 12, 4, 40
  a = rollout.slots.admission_rows(G, 3, G=G, M=M, R=R, budget=R)
  a["slots"][:] = rng.permutation(G)
  a["prompt"][:] = rng.integers(1, 3, (G, 3))
  a["prompt_len"][:] = rng.integers(1, 4, G)
  stems = rng.integers(5, 8, (3, R))
  resume = []
  for b in range(G):
    for m in range(M):
      ids = stems[rng.integers(3)].copy()
      ids[rng.integers(1, R):] = rng.integers(5, 8)  # part ways at a random point
      a["tokens"][b, m] = ids
      if b % 4 == 0:  # a fresh group: its samples alike
        a["tokens"][b, m] = a["tokens"][b, 0]
      if rng.random() < 0.8 or b % 4 == 0:
        resume.append((b, m, int(a["slots"][b]), R // 2 if b % 4 == 0 else
                       int(rng.integers(1, R))))
  shard = rng.integers(0, 2, G)
  resident = [(G + i, 0, tuple(rng.integers(1, 3, int(rng.integers(1, 4))).tolist()),
               stems[rng.integers(3)][:int(rng.integers(1, R))], int(rng.integers(2)))
              for i in range(6)]
  cases = [(None, (), None), (None, (), 4), (shard, (), None), (shard, resident, None),
           (shard, resident, 4), (shard, resident, 8)]
  for sh, res, page in cases:
    got = rollout.slots.forks(a, resume, sh, res, page)
    assert got == _forks_by_scanning(a, resume, sh, res, page)
    assert got[1]  # forks happened


def test_the_prompt_bucket_of_an_admission_minimises_the_tokens_computed():
  """``loop.prompt_bucket`` (the prompt on pages): the bucket Pb whose cost, Bn·Pb for the
  admission plus the re-prefill calls of the longer prompts' first samples
  (``slots.resume_calls``), is least, of equal costs the larger, as a scan of every bucket
  finds, where it is at most 2/3 of the whole prompts' cost (else the whole prompts' one);
  short prompts come in whole, one long prompt among short ones is re-prefilled."""
  e = types.SimpleNamespace(G=8, M=8, R=4096)

  def scan(lengths, Bn):
    costs = []
    for Pb in rollout.slots.buckets(8, rollout.records.pow2(max(lengths), 8)):
      rest = [n - 2 for n in lengths if n > Pb]
      calls = rollout.slots.resume_calls(rest, G=e.G, M=e.M, R=e.R) if rest else []
      costs.append((Bn * Pb + sum(Br * T for _, (Br, T) in calls), -Pb))
    cost, Pb = min(costs)
    return -Pb if 3 * cost <= 2 * costs[-1][0] else -costs[-1][1]

  rng = np.random.default_rng(0)
  for _ in range(40):
    lengths = rng.integers(2, 2048, int(rng.integers(1, 9))).tolist()
    Bn = min(8, rollout.records.pow2(len(lengths), 4))
    assert rollout.loop.prompt_bucket(e, lengths, Bn) == scan(lengths, Bn)
  assert rollout.loop.prompt_bucket(e, [10, 12, 24, 9], 4) == 32  # all whole
  assert rollout.loop.prompt_bucket(e, [2048] + [40] * 7, 8) == 64  # one re-prefilled
  # a bucket of 8 computes 384 tokens (256, and 16 rows re-prefilled: 16 x 8) against 512
  quickstart = types.SimpleNamespace(G=32, M=8, R=16)
  assert rollout.loop.prompt_bucket(quickstart, [8] * 16 + [10] * 16, 32) == 16
