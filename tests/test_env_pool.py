"""``rl_jax.rollout.env_pool.EnvPool``: steps that hang do not hold the steps behind them."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rl_jax.envs.base import Message, StepResult
from rl_jax.rollout.env_pool import EnvPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Env:
  """``step`` sleeps ``sleep`` seconds (or until ``release`` is set), then ends."""

  def __init__(self, sleep=0.0, release=None):
    self.sleep, self.release = sleep, release

  def step(self, action):
    if self.release is not None:
      self.release.wait()
    time.sleep(self.sleep)
    return StepResult((Message("tool", action),), reward=1.0)


def _render(messages):
  return [len(m.content) for m in messages], tuple(messages), False


@pytest.mark.timeout(60)  # the hang this guards against
def test_steps_behind_hung_ones_start_when_those_time_out(capsys):
  """Every worker stuck in a step that never returns: once those time out, the steps waiting
  behind them start on new threads and finish (before, they waited for a free worker
  forever, and the run hung)."""
  release = threading.Event()
  pool = EnvPool(workers=2, timeout=0.2)
  for k in range(2):
    pool.submit(("hung", k), _Env(release=release), "x", _render)
  for k in range(3):
    pool.submit(("quick", k), _Env(sleep=0.01), "abc", _render)
  start = time.monotonic()
  out = dict(pool.take(pool.keys()))
  took = time.monotonic() - start
  release.set()
  assert [out[("hung", k)].timed_out for k in range(2)] == [True, True]
  assert "timed out after 0.2 s" in out[("hung", 0)].error
  for k in range(3):
    assert not out[("quick", k)].timed_out and out[("quick", k)].result.reward == 1.0
    assert out[("quick", k)].ids == [3]
  assert took < 5.0, took
  notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
  assert len(notes) == 1 and "ran past env.step_timeout_s=0.2 s" in notes[0], notes


def test_at_most_workers_steps_run_at_once():
  """The limit holds for steps that do not time out."""
  running, peak, lock = [0], [0], threading.Lock()

  class Counting:
    def step(self, action):
      with lock:
        running[0] += 1
        peak[0] = max(peak[0], running[0])
      time.sleep(0.05)
      with lock:
        running[0] -= 1
      return StepResult((), reward=0.0, done=True)

  pool = EnvPool(workers=3, timeout=None)
  for k in range(10):
    pool.submit(k, Counting(), "", _render)
  out = pool.take(list(range(10)))
  assert [k for k, _ in out] == list(range(10)) and peak[0] == 3


def test_a_step_that_never_returns_does_not_keep_the_process_alive():
  code = textwrap.dedent("""
      import threading
      from rl_jax.rollout.env_pool import EnvPool
      class Forever:
        def step(self, action):
          threading.Event().wait()
      pool = EnvPool(workers=1, timeout=0.1)
      pool.submit(0, Forever(), "", lambda m: ([], (), False))
      (_, outcome), = pool.take([0])
      print(outcome.timed_out)
      """)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]
