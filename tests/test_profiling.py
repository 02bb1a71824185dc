"""The profile summary: exclusive op times from a real ``jax.profiler`` trace, and the
trainer's ``train.profile_step``."""

import time

import jax
import jax.numpy as jnp
import pytest

from rl_jax import config_utils, profiling, train
from tests.tiny import QUICKSTART, TINY_MODEL


def test_exclusive_time_subtracts_nested_events_on_the_same_thread():
  ev = [dict(ph="X", pid=1, tid=1, ts=0, dur=100, name="while"),
        dict(ph="X", pid=1, tid=1, ts=10, dur=30, name="a"),
        dict(ph="X", pid=1, tid=1, ts=50, dur=20, name="b"),
        dict(ph="X", pid=1, tid=1, ts=55, dur=5, name="c"),     # inside b
        dict(ph="X", pid=1, tid=2, ts=20, dur=40, name="other thread"),
        dict(ph="X", pid=1, tid=1, ts=200, dur=7, name="after")]
  got = {e["name"]: t for e, t in profiling.exclusive_times(ev)}
  assert got == {"while": 50.0, "a": 30.0, "b": 15.0, "c": 5.0, "other thread": 40.0,
                 "after": 7.0}


def test_kind_of_op():
  assert profiling.kind("ynn_fusion.3") == "matmul"
  assert profiling.kind("dot.12") == "matmul"
  assert profiling.kind("copy_bitcast_fusion.18") == "copy/transpose"
  assert profiling.kind("while.4") == "loop"
  assert profiling.kind("add_divide_fusion") == "other"


def test_summary_of_a_real_trace_ranks_the_matmul_program_first(tmp_path):
  """A program doing a large matmul and one doing a small add, traced for real: the summary
  counts every call of each and puts the matmul program first; the exclusive op time of a
  program is within the wall time its calls took."""
  def matmul(a, b):
    return a @ b

  def add_one(x):
    return x + 1.0

  big, small = jax.jit(matmul), jax.jit(add_one)
  a = jnp.ones((512, 512)); x = jnp.ones((8,))
  jax.block_until_ready((big(a, a), small(x)))
  jax.profiler.start_trace(str(tmp_path), create_perfetto_trace=True)
  t0 = time.perf_counter()
  for _ in range(3):
    jax.block_until_ready(big(a, a))
  wall = time.perf_counter() - t0
  for _ in range(5):
    jax.block_until_ready(small(x))
  jax.profiler.stop_trace()
  rows = profiling.op_times(profiling.load_events(str(tmp_path)))
  mm = [r for r in rows if r.module == "jit_matmul"]
  add = [r for r in rows if r.module == "jit_add_one"]
  assert [r.calls for r in mm if profiling.kind(r.op) == "matmul"] == [3]
  assert max(r.calls for r in add) == 5
  assert 0 < sum(r.micros for r in mm) / 1e6 <= wall * 2  # op threads may overlap
  assert rows[0].module == "jit_matmul"
  assert sum(r.micros for r in mm) > 10 * sum(r.micros for r in add)
  text = profiling.summarize(str(tmp_path))
  assert "| kind of op |" in text and "matmul" in text


def test_missing_trace_fails_in_one_line(tmp_path):
  with pytest.raises(FileNotFoundError, match="no \\*.trace.json.gz"):
    profiling.load_events(str(tmp_path))


def test_profile_step_writes_a_trace_and_its_summary(tmp_path):
  config = config_utils.load_config(QUICKSTART, TINY_MODEL + [
      "sft.steps=1", "sft.batch_size=8", "train.steps=3", "train.batch_groups=2",
      "rollout.n=4", "train.eval_every=0", "train.checkpoint_every=0",
      "log.tensorboard=False", "train.profile_step=3"])
  train.train(config, str(tmp_path), progress=False)
  summary = (tmp_path / "profile" / "summary.txt").read_text()
  assert "jit_update" in summary  # step 3 is an RL step: its update was traced
  assert summary == profiling.summarize(str(tmp_path / "profile"))
