"""Isolated rewards (rl_jax.data.rewards) and DAPO overlong shaping."""

import threading
import time

import chex
import numpy as np
import pytest

from rl_jax.data import rewards, verifiers


def _exact(c, r):
  return float(c == r)


def _raises(c, r):
  if c == "boom":
    raise RuntimeError("verifier bug")
  return float(c == r)


def test_rewards_and_exceptions():
  out, stats = rewards.compute_rewards(_raises, ["a", "boom", "b", "c"], ["a", "x", "x", "c"])
  chex.assert_shape(out, (4,))  # [B]
  chex.assert_type(out, np.float32)
  assert out.tolist() == [1.0, 0.0, 0.0, 1.0]
  assert stats == {"exceptions": 1, "timeouts": 0, "errors": ["RuntimeError: verifier bug"]}
  out, stats = rewards.compute_rewards(lambda c, r: float("nan") if c else "x", ["a", ""],
                                       [None, None])
  assert out.tolist() == [0.0, 0.0] and stats["exceptions"] == 2
  assert stats["errors"] == ["it returned nan, not a finite number",
                             "it returned 'x', not a finite number"]


def test_the_first_distinct_failures_are_printed_once(capsys):
  """A verifier failing on every row is not only counted: its first three distinct
  failures are printed, each once per process, however many steps repeat them."""
  who = "the verifier of test_the_first_distinct_failures_are_printed_once"
  for _ in range(2):  # two steps with the same failures
    _, stats = rewards.verify_rows(lambda c, r: {"a": 1.0}[c], ["a", "b", "b", "c", "d", "e"],
                                   [None] * 6)
    assert stats["exceptions"] == 5 and stats["errors"] == ["KeyError: 'b'", "KeyError: 'c'",
                                                            "KeyError: 'd'"]
    rewards.note_failures(who, stats["errors"])
  lines = capsys.readouterr().err.splitlines()
  assert lines == [f"note: {who} failed on a row, which scores 0 (counted in reward_exceptions "
                   f"or reward_timeouts): KeyError: '{k}'" for k in "bcd"]


def _spin_swallowing(c, r):
  """Busy loop that swallows ordinary exceptions, as some verifiers do."""
  if c != "hang":
    return 1.0
  while True:
    try:
      sum(range(1000))
    except Exception:  # noqa: BLE001
      return 1.0


def test_signal_timeout_interrupts_pure_python_loop():
  start = time.perf_counter()
  out, stats = rewards.compute_rewards(_spin_swallowing, ["ok", "hang", "ok"], [0, 0, 0],
                                       timeout_s=0.05, isolation="signal")
  assert time.perf_counter() - start < 2.0
  assert out.tolist() == [1.0, 0.0, 1.0] and stats == {
      "exceptions": 0, "timeouts": 1,
      "errors": ["a call took longer than data.reward_timeout_s=0.05 s"]}
  # The timer is disarmed afterwards: a later slow-ish call is not hit by a stale alarm.
  time.sleep(0.1)


def test_thread_timeout_and_auto_off_main_thread():
  def slow(c, r):
    time.sleep(0.3 if c == "slow" else 0.0)
    return 1.0

  out, stats = rewards.compute_rewards(slow, ["slow", "fast"], [0, 0], timeout_s=0.05,
                                       isolation="thread")
  assert out.tolist() == [0.0, 1.0] and stats["timeouts"] == 1
  result = {}

  def worker():
    result["value"] = rewards.compute_rewards(_raises, ["boom", "a"], ["a", "a"])

  t = threading.Thread(target=worker)
  t.start()
  t.join()
  assert result["value"][0].tolist() == [0.0, 1.0]
  errors = []

  def signal_off_main():
    try:
      rewards.compute_rewards(_exact, ["a"], ["a"], isolation="signal")
    except ValueError as e:
      errors.append(str(e))

  t = threading.Thread(target=signal_off_main)
  t.start()
  t.join()
  assert errors and "main thread" in errors[0]


def test_math_reward_through_compute_rewards():
  out, stats = rewards.compute_rewards(verifiers.math_reward,
                                       ["\\boxed{\\frac{1}{2}}", "#### 7", "no answer"],
                                       ["0.5", "8", "1"], timeout_s=5.0)
  assert out.tolist() == [1.0, 0.0, 0.0] and stats == {"exceptions": 0, "timeouts": 0}


def test_argument_errors():
  with pytest.raises(ValueError, match="2 completions but 1 references"):
    rewards.compute_rewards(_exact, ["a", "b"], ["a"])
  with pytest.raises(ValueError, match="timeout_s"):
    rewards.compute_rewards(_exact, ["a"], ["a"], timeout_s=0)
  with pytest.raises(ValueError, match="unknown isolation"):
    rewards.compute_rewards(_exact, ["a"], ["a"], isolation="process")


def test_overlong_penalty_hand_values():
  # L_max = 20, L_cache = 4: free up to 16, then −1/4 per token, −1 past 20.
  got = rewards.overlong_penalty([0, 10, 16, 17, 18, 20, 21, 50], 20, 4)
  chex.assert_type(got, np.float32)
  chex.assert_trees_all_close(got, np.array([0, 0, 0, -0.25, -0.5, -1.0, -1.0, -1.0],
                                            np.float32))
  with pytest.raises(ValueError, match="cache_length"):
    rewards.overlong_penalty([1], 10, 0)
