"""The trainer's prompt-selection stage on hand cases: DAPO dynamic sampling (always G
informative groups, or a reported shortfall), GRESO skipping, Beta-posterior selection,
overlong shaping and the dapo preset's defaults."""

import math

import numpy as np
import pytest

from rl_jax import config as base
from rl_jax.data import selection
from rl_jax.train import selection_stage as ss
from rl_jax.train.rollouts import Scored
from rl_jax.train.streams import Stream, seed_for
from tests import tiny

N, G, M, R = 40, 4, 4, 3


def _config(**data):
  c = base.base_config()
  c.train.batch_groups, c.rollout.n, c.rollout.max_new_tokens = G, M, R
  c.data.update(data)
  return c


_how = tiny.selection_of


def _state(c):
  how, geo = _how(c)
  return ss.selector_state(how.kind, geo.adaptive, N)


def _sampler(c):
  def nxt(data, n):
    idx, st = selection.sampler_next(selection.SamplerState(c.data.seed, int(data[0]),
                                                            int(data[1])), N, n)
    return idx, np.asarray([st.epoch, st.position], np.int32)
  return nxt


def _roller(table, calls):
  """Scored groups whose rewards are ``table[prompt]`` (a real function of the prompt)."""
  def roll(idx, first):
    calls.append((list(idx), first))
    g = len(idx)
    tok = np.tile(np.asarray(idx, np.int32)[:, None, None], (1, M, R)).reshape(g * M, R)
    prompts = np.tile(np.asarray(idx, np.int32)[:, None], (1, 3))  # a prompt's ids: its index
    return Scored(np.asarray(idx, np.int32), prompts, np.full(g, 3, np.int32), tok,
                  np.ones((g * M, R), bool),
                  np.zeros((g * M, R), np.float32), np.zeros((g * M, R), np.int32),
                  table[np.asarray(idx)].astype(np.float32), np.zeros(2, np.int64), 0.5, 0,
                  {"rollout_tokens": float(g * M * R)})
  return roll


def _table(informative):
  """Rewards [N,M]: mixed for prompts in ``informative``, all-0 or all-1 otherwise."""
  t = np.zeros((N, M))
  t[1::2] = 1.0
  for i in informative:
    t[i] = [0, 1, 0, 0]
  return t


def test_dapo_fills_the_batch_with_informative_groups_in_draw_order():
  c = _config(selector="dapo", max_tries=10)
  order, _ = _sampler(c)(np.zeros(2), 3 * G)
  informative = [int(i) for i in order[[1, 6, 7, 9, 10]]]  # 1 in draw 0, 2 in 1, 2 in 2
  calls = []
  out, data, new, stats = ss.select(*_how(c), np.zeros(2, np.int32), {}, _sampler(c),
                                    _roller(_table(informative), calls), step=0)
  assert [f for _, f in calls] == [0, G, 2 * G]  # distinct key streams per try
  assert list(out.indices) == informative[:G]  # first G informative, in draw order
  assert np.all(np.ptp(out.rewards, axis=1) > 0)
  assert out.tokens.shape == (G * M, R) and np.all(out.tokens[::M, 0] == out.indices)
  # each picked group keeps its own prompt ids
  assert out.prompts.shape == (G, 3) and np.all(out.prompts.T == out.indices)
  assert out.prompts.dtype == out.prompt_lens.dtype == np.int32
  assert stats["dynamic_sampling_short"] == 0 and stats["dynamic_sampling_tries"] == 3
  assert stats["dynamic_sampling_dropped"] == 2 * G and new is None
  assert out.stats["rollout_tokens"] == 3 * G * M * R and out.rollout_s == 1.5
  assert list(data) == [0, 3 * G]


def test_dapo_reports_a_short_batch_instead_of_failing():
  c = _config(selector="dapo", max_tries=2)
  order, _ = _sampler(c)(np.zeros(2), 2 * G)
  informative = [int(order[5])]
  out, _, _, stats = ss.select(*_how(c), np.zeros(2, np.int32), {}, _sampler(c),
                               _roller(_table(informative), []), step=0)
  assert len(out.indices) == G  # never a short batch
  assert stats["dynamic_sampling_short"] == G - 1
  # the informative group plus the earliest zero-variance ones, in draw order
  assert list(out.indices) == [int(i) for i in order[[0, 1, 2, 5]]]


def test_dapo_with_one_try_is_plain_sampling():
  c = _config(selector="dapo", max_tries=1)
  out, _, _, stats = ss.select(*_how(c), np.zeros(2, np.int32), {}, _sampler(c),
                               _roller(_table([]), []), step=0)
  plain, _ = _sampler(c)(np.zeros(2), G)
  assert list(out.indices) == list(plain) and stats["dynamic_sampling_short"] == G


def test_greso_skips_from_streaks_and_updates_its_state():
  c = _config(selector="greso", max_tries=10)
  sel = _state(c)
  seed = seed_for(c.train.seed, 0, Stream.SELECTOR)
  table = _table([])
  data = np.zeros(2, np.int32)
  for step in range(4):  # 16 prompts per epoch-step: revisits after 10 steps at most
    before = {k: v.copy() for k, v in sel.items()}
    out, data2, sel, stats = ss.select(*_how(c), data, sel, _sampler(c), _roller(table, []), step)
    gs = selection.GresoState(before["streak"], before["kind"], float(before["p"][0]),
                              float(before["p"][1]), seed)
    idx, sampler, skipped = selection.greso_select(
        selection.SamplerState(0, int(data[0]), int(data[1])), gs, G, step, 10)
    assert list(out.indices) == list(idx) and stats["skipped_prompts"] == skipped
    assert list(data2) == [sampler.epoch, sampler.position]
    ref = selection.greso_update(gs, idx, table[idx])
    np.testing.assert_array_equal(sel["streak"], ref.streak)
    np.testing.assert_allclose(sel["p"], [ref.p_easy, ref.p_hard], rtol=1e-6)
    data = data2
  # every rolled-out group had zero variance (no revisit yet): streak 1 on each
  assert sel["streak"].max() == 1 and sel["streak"].sum() == 4 * G


def test_greso_skips_a_prompt_with_a_long_streak():
  c = _config(selector="greso")
  sel = _state(c)
  sel["streak"][:] = 30  # p^30 < 0.01: skip with probability 0.99
  sel["kind"][:] = 1
  _, _, _, stats = ss.select(*_how(c), np.zeros(2, np.int32), sel, _sampler(c),
                             _roller(_table([]), []), step=0)
  assert stats["skipped_prompts"] >= 30  # about 0.99 of the 40 candidates drawn


def test_beta_picks_by_posterior_and_decays_toward_the_prior():
  c = _config(selector="beta", select_pool=2.5, beta_mode="variance", beta_decay=0.5)
  sel = _state(c)
  sel["alpha"][:] = 1.0
  sel["beta"][:] = 9.0  # mean 0.1
  cand, _ = _sampler(c)(np.zeros(2), math.ceil(2.5 * G))
  best = [int(i) for i in cand[[2, 5, 7, 8]]]
  sel["alpha"][best] = 5.0
  sel["beta"][best] = 5.0  # mean 0.5: the largest mu(1 - mu)
  table = _table([])
  out, data, new, stats = ss.select(*_how(c), np.zeros(2, np.int32), sel, _sampler(c),
                                    _roller(table, []), step=3)
  assert sorted(out.indices) == sorted(best)
  assert stats["skipped_prompts"] == 10 - G and list(data) == [0, 10]
  i = best[0]
  k = np.sum(table[i] > 0.5)
  assert new["alpha"][i] == pytest.approx(0.5 * 5 + 0.5 * 1 + k)
  assert new["beta"][i] == pytest.approx(0.5 * 5 + 0.5 * 1 + (M - k))
  j = int(cand[0])  # a candidate not picked: decay only
  assert new["alpha"][j] == pytest.approx(1.0) and new["beta"][j] == pytest.approx(5.0)


def test_overlong_shaping_and_the_dapo_preset_defaults():
  c = _config()
  c.rollout.max_new_tokens = 8
  r = np.ones(4, np.float32)
  np.testing.assert_array_equal(ss.shape_rewards(_how(c)[0], r, np.asarray([2, 6, 7, 8])), r)
  c.loss.preset = "dapo"  # L_cache = 8 // 4 = 2: ramp over lengths 7..8
  how = _how(c)[0]
  assert how.kind == "dapo" and how.overlong == 2
  np.testing.assert_allclose(ss.shape_rewards(how, r, np.asarray([2, 6, 7, 8])),
                             [1.0, 1.0, 0.5, 0.0])
  c.data.overlong_buffer = 0
  c.rollout.partial = True
  how = _how(c)[0]
  assert how.overlong == 0 and how.kind == "none"
  assert ss.effective_selector("none", "dapo", False) == "dapo"
  assert ss.overlong_buffer(None, "grpo", 8) == 0 and ss.overlong_buffer(3, "grpo", 8) == 3


def test_sort_mix_has_easy_learnable_and_impossible_prompts():
  from rl_jax.data import tasks  # pylint: disable=import-outside-toplevel
  task = tasks.get_task("sort_mix", difficulty=0)
  train, held = task.split("train"), task.split("eval")
  assert len(train) + len(held) == 300 and not {e.prompt for e in train} & {e.prompt for e in held}
  by_kind = {k: [e for e in train if e.prompt.startswith(k)] for k in ("copy", "sort", "hash")}
  assert all(60 < len(v) < 100 for v in by_kind.values())
  assert all(e.answer == e.prompt[5:-1] for e in by_kind["copy"])
  assert all(e.answer == "".join(sorted(e.prompt[5:-1])) for e in by_kind["sort"])
  hashed = by_kind["hash"]
  assert np.mean([e.answer == "".join(sorted(e.prompt[5:-1])) for e in hashed]) < 0.2
  assert task.verify(" 12 ", "12") == 1.0 and len(tasks.get_task("sort_mix", 2).split("train")) > 200


def test_speculative_drafts_have_a_size_limit():
  from rl_jax.errors import ConfigError  # pylint: disable=import-outside-toplevel
  from rl_jax.train import speculative_stage  # pylint: disable=import-outside-toplevel
  geo = base.geometry(_config())
  assert speculative_stage.drafts_state(False, geo, N, 7) == {}  # rollout.speculative off
  d = speculative_stage.drafts_state(True, geo, N, 7)
  assert d["logq"].shape == (N, M, R, 7) and not d["length"].any()
  with pytest.raises(ConfigError, match="rollout.speculative"):
    speculative_stage.drafts_state(True, geo, 10**6, 150_000)
