"""XLA options rl_jax can compile its programs with, per backend (``train.cpu_fast_compile``).

On CPU, XLA's MLIR fusion emitters (its default) take markedly longer to compile than its
elemental IR emitter, and where a program's time goes to matmuls (library calls either way)
the code they make runs no faster. With ``use_fast_cpu_compile(True)`` (what
``--config.train.cpu_fast_compile=True`` does when the run is set up), rl_jax's training
programs (``train.layout.jit_on_mesh``: the RL update, the log-prob and value passes, the SFT
step) and the sampler's prefill (``RolloutEngine.admit_fn``) made from then on are compiled
with the elemental emitter (``xla_cpu_use_fusion_emitters=False``). On
``scripts/bench_tunix.py``'s model (2-core AMD EPYC, JAX 0.10.2) the RL update compiles in
2.6 s instead of 3.4-3.7 s and the prefill in 0.6 s instead of 0.8 s, with the same step time.
Values agree to float rounding (``tests/test_compile_options.py``): the quickstart's are
the same bit for bit, a LoRA run's differ in the last bit from its first steps and drift, so
the option is off by default and the documented training numbers are without it. The decode
loop keeps XLA's default either way: its elementwise work is a larger share of each step, and
with the elemental emitter it sampled about 5% fewer tokens per second.

Other backends get no options, nor does a jaxlib whose XLA no longer knows the option:
``fast_compile_options`` tries it once on a tiny program.
"""

from __future__ import annotations

import functools
from typing import Iterable

import jax
import jax.numpy as jnp

__all__ = ["CPU_FAST_COMPILE", "fast_compile_options", "use_fast_cpu_compile"]

CPU_FAST_COMPILE = {"xla_cpu_use_fusion_emitters": False}
_ENABLED = [False]  # the process's setting (use_fast_cpu_compile)


def use_fast_cpu_compile(enabled: bool) -> None:
  """Whether programs made from now on in this process get ``CPU_FAST_COMPILE`` on CPU
  (``train.cpu_fast_compile``; every run's setup sets it)."""
  _ENABLED[0] = bool(enabled)


@functools.cache
def _cpu_accepts(options: tuple) -> bool:
  """Whether this jaxlib's CPU compiler takes ``options`` (compiles a 2-element add on a CPU
  device, whatever the default backend is)."""
  try:
    x = jnp.zeros(2, device=jax.devices("cpu")[0])
    jax.jit(lambda x: x + 1).lower(x).compile(dict(options))
  except jax.errors.JaxRuntimeError:
    return False
  return True


def fast_compile_options(devices: Iterable[jax.Device]) -> dict:
  """The ``compiler_options`` for a training program on ``devices``: ``CPU_FAST_COMPILE``
  when ``use_fast_cpu_compile`` is on, the devices are all CPU devices and the compiler
  takes them; else none."""
  if not _ENABLED[0] or any(d.platform != "cpu" for d in devices):
    return {}
  options = tuple(sorted(CPU_FAST_COMPILE.items()))
  return dict(options) if _cpu_accepts(options) else {}
