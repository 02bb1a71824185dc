"""The held groups both engines keep between rollout_groups calls (rl_jax.rollout.held):
APRIL's serving order, the staleness bound's restarts and the uid counter, on plain records."""

import dataclasses

import numpy as np
import pytest

from rl_jax.rollout.held import HeldGroups, lag_stats, rows
from rl_jax.rollout.records import RolloutError


@dataclasses.dataclass
class G:
  uid: int
  versions: list
  done: bool = False
  resumed: int = 0
  started: bool = True


def test_serving_order_is_ready_then_buffer_then_new_within_the_budget():
  h = HeldGroups()
  h.ready.extend([G(0, [], True), G(1, [], True)])
  h.buffer.extend([G(2, []), G(3, [])])
  fresh = iter(range(10, 20))
  result, submit, need = h.serve(3, 2.0, None, lambda: G(next(fresh), []))
  # two complete extras count towards K=3; ceil(2.0 * 3) - 2 = 4 in flight: buffer, then new
  assert [g.uid for g in result] == [0, 1] and need == 1
  assert [g.uid for g in submit] == [2, 3, 10, 11]
  # the staleness bound caps what is in flight: (eta + 1) * K - held complete
  h2 = HeldGroups()
  _, submit, need = h2.serve(2, 4.0, 0, lambda: G(next(fresh), []))
  assert len(submit) == 2 and need == 2
  # a source that runs out stops submission
  _, submit, _ = HeldGroups().serve(4, 2.0, None, lambda: None)
  assert submit == []


def test_settle_keeps_extras_and_puts_the_unfinished_in_front():
  h = HeldGroups()
  h.buffer.append(G(9, []))
  result = [G(0, [], True)]
  complete = [G(1, [], True), G(2, [], True)]
  unfinished = [G(3, [], started=False), G(4, [])]
  aborted = h.settle(result, complete, unfinished, 1, started=lambda g: g.started)
  assert [g.uid for g in result] == [0, 1] and [g.uid for g in h.ready] == [2]
  assert [g.uid for g in h.buffer] == [3, 4, 9]
  assert aborted == 1 and (unfinished[0].resumed, unfinished[1].resumed) == (0, 1)


def test_staleness_restarts_old_samples_and_demotes_their_complete_groups():
  h = HeldGroups()
  old, fresh = G(0, [3, 5], True), G(1, [6, 7], True)
  h.ready.extend([old, fresh])
  h.buffer.append(G(2, [2]))
  seen = []

  def restart(g, oldest):
    seen.append((g.uid, oldest))
    if min(g.versions) < oldest:
      g.versions, g.done = [], False
      return 1
    return 0

  assert h.enforce_staleness(7, 2, restart) == 2  # versions below 5 restart
  assert seen == [(2, 5), (0, 5), (1, 5)]  # buffer first, then ready
  assert [g.uid for g in h.ready] == [1] and [g.uid for g in h.buffer] == [0, 2]
  assert HeldGroups().enforce_staleness(7, None, restart) == 0


def test_uids_continue_across_a_checkpoint():
  h = HeldGroups()
  assert [h.new_uid(), h.new_uid()] == [0, 1]
  assert h.next_uid() == 2 and h.new_uid() == 2  # peeking does not consume
  a, b = G(5, [], True), G(6, [])
  h2 = HeldGroups()
  h2.replace(h.held() + [(a, True), (b, False)], h.next_uid())
  assert h2.held() == [(a, True), (b, False)] and h2.new_uid() == 3


def test_lag_stats_count_the_masked_tokens_only():
  versions = np.array([[4, 4, 2, 0], [3, 4, 1, 1]], np.int32)
  mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
  s = lag_stats(versions, mask, 4)
  assert s == dict(max_token_lag=2, off_policy_token_fraction=2 / 5)
  assert lag_stats(versions, np.zeros_like(mask), 4) == dict(max_token_lag=0,
                                                              off_policy_token_fraction=0.0)


@dataclasses.dataclass
class P:
  uid: int
  prompt: list
  meta: int | None
  resumed: int = 0
  done: bool = False


def test_the_group_arrays_of_a_checkpoint_give_the_held_groups_back():
  h = HeldGroups()
  for _ in range(7):
    h.new_uid()
  h.ready.append(P(3, [5, 6, 7], 12, 1, True))
  h.buffer.extend([P(4, [9], None, 2), P(6, [1, 2], 0)])
  d, groups = h.export(5, 4)
  assert [g.uid for g in groups] == [3, 4, 6] and int(d["next_uid"]) == 7
  assert d["valid"].tolist() == [True, True, True, False, False]
  assert d["prompt"].shape == (5, 4) and d["meta"].tolist() == [12, -1, 0, -1, -1]
  back = rows(d)
  assert [(r.h, r.uid, r.resumed, r.meta, r.prompt, r.ready) for r in back] == [
      (0, 3, 1, 12, [5, 6, 7], True), (1, 4, 2, None, [9], False), (2, 6, 0, 0, [1, 2], False)]
  with pytest.raises(RolloutError, match="3 held groups do not fit capacity 2"):
    h.export(2, 4)
