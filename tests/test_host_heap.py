"""``rl_jax.host_heap`` (``train.host_heap_reuse``): XLA's large per-call host blocks reused
instead of faulted in on every call. Process-wide settings, so the measured cases run in
fresh subprocesses."""

import json
import subprocess
import sys

import pytest

from rl_jax import config_utils, host_heap, train
from tests.tiny import QUICKSTART, TINY_MODEL

# a program whose temporaries are one 48 MiB block (the [1024, 12288] product), above glibc's
# largest mmap threshold; minor page faults per call after the first, and its result
_PROBE = """
import json, resource, sys
import numpy as np
from rl_jax import host_heap
on = host_heap.reuse_large_blocks() if sys.argv[1] == "on" else False
import jax, jax.numpy as jnp
x = jnp.asarray(np.random.default_rng(0).standard_normal((1024, 64)), jnp.float32)
w1 = jnp.asarray(np.random.default_rng(1).standard_normal((64, 12288)), jnp.float32)
w2 = jnp.asarray(np.random.default_rng(2).standard_normal((12288, 4)), jnp.float32)
f = jax.jit(lambda x, w1, w2: jnp.tanh(x @ w1) @ w2)
first = np.asarray(f(x, w1, w2))
faults = []
for _ in range(7):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  out = np.asarray(f(x, w1, w2))
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"on": on, "faults": faults, "sum": float(out.astype(np.float64).sum()),
                  "same": bool((out == first).all())}))
"""


def _probe(mode: str) -> dict:
  out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                       check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(host_heap._glibc_mallopt() is None, reason="needs glibc")  # pylint: disable=protected-access
def test_reused_blocks_are_not_faulted_in_again_and_values_are_unchanged():
  default, reused = _probe("off"), _probe("on")
  assert not default["on"] and reused["on"]
  # each call maps the 48 MiB block afresh: ~12,000 pages faulted in per call; reused, most
  # calls fault none (the heap's free space can still be split by other buffers now and then)
  assert min(default["faults"]) > 6000, default
  assert sorted(reused["faults"])[3] < 1000, reused
  assert reused["same"] and default["same"]
  assert reused["sum"] == pytest.approx(default["sum"], rel=1e-6)


def test_too_late_in_a_process_is_one_clear_error():
  """This process has computed with JAX already: the setting cannot move the programs'
  allocations any more, and a run that asks for it stops before building anything."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  jnp.zeros(2).block_until_ready()
  if host_heap._glibc_mallopt() is None:  # pylint: disable=protected-access
    assert host_heap.reuse_large_blocks() is False
    return
  with pytest.raises(RuntimeError, match="before the process's first JAX computation"):
    host_heap.reuse_large_blocks()
  assert not host_heap.reusing()
  config = config_utils.load_config(QUICKSTART, TINY_MODEL + ["train.host_heap_reuse=True"])
  with pytest.raises(RuntimeError, match="rl_jax.host_heap.reuse_large_blocks"):
    train.build_setup(config)


def test_cli_applies_it_before_the_run_when_asked(monkeypatch, tmp_path):
  """``python -m rl_jax.train ... --config.train.host_heap_reuse=True`` reuses the heap before
  anything of the run is built (and not at all without the flag)."""
  from rl_jax.train import loop  # pylint: disable=import-outside-toplevel
  calls = []
  monkeypatch.setattr(host_heap, "reuse_large_blocks", lambda: calls.append("heap") or True)
  monkeypatch.setattr(loop, "train", lambda config, workdir: calls.append("train"))
  argv = ["rl_jax.train", f"--config={QUICKSTART}", f"--workdir={tmp_path / 'run'}"]
  loop.main(argv + ["--config.train.host_heap_reuse=True"])
  assert calls == ["heap", "train"]
  loop.main(argv)
  assert calls == ["heap", "train", "train"]
