"""XLA options rl_jax compiles its programs with, per backend (``train.cpu_fast_compile``,
``train.cpu_xla_reductions``, both on by default; ``train.cpu_temp_block_mib``, opt-in; only
CPU programs get them).

On CPU, XLA's MLIR fusion emitters (its default) take markedly longer to compile than its
elemental IR emitter, and where a program's time goes to matmuls (library calls either way)
the code they make runs no faster. With ``use_fast_cpu_compile(True)`` (what
``train.cpu_fast_compile``, on by default, does when the run is set up), rl_jax's training
programs (``train.layout.jit_on_mesh``: the RL update, the log-prob and value passes, the SFT
step) and the sampler's prefill (``RolloutEngine.admit_fn``) made from then on are compiled
with the elemental emitter (``xla_cpu_use_fusion_emitters=False``) and LLVM's -O1 pipeline
(``xla_backend_optimization_level=1``; XLA's default level is 3). On ``scripts/bench_tunix.py``'s
model (2-core AMD EPYC, JAX 0.10.2) the elemental emitter alone took the RL update's compile
from 3.4-3.7 s to 2.6 s and the prefill's from 0.8 s to 0.6 s; -O1 takes the update to
1.6-2.5 s and the prefill to 0.4-0.55 s, with the same step time (docs/BENCHMARKS.md, "First
GRPO step: one advantage program, and -O1"). Values agree with XLA's defaults to float
rounding (``tests/test_compile_options.py``), but the last bits differ and a run's numbers
drift: ``--config.train.cpu_fast_compile=False`` gives XLA's defaults, and the numbers
documented before these options became the defaults. The decode loop keeps XLA's default
either way: its elementwise work is a larger share of each step, and with the elemental
emitter it sampled about 5% fewer tokens per second.

With ``use_cpu_xla_reductions(True)`` (``train.cpu_xla_reductions``, on by default) the same
training programs hand only their matmuls to YNNPACK, XLA's CPU matmul library
(``xla_cpu_experimental_ynn_fusion_type``), and compile their reductions as XLA's own
loops. YNNPACK's reductions are slow on the row sums a backward pass is full of: the RMSNorm
weight gradient of a 1034 x 256 activation (a multiply and a sum over the rows) took 1.4 ms
per call, and such sums were about 21 ms of op time in the 137 ms RL update of
``scripts/bench_tunix.py``'s model, which is 1.11x faster with the option
(``scripts/bench_update.py``). Sums are added in another order, so values agree to float
rounding (``tests/test_compile_options.py``); ``--config.train.cpu_xla_reductions=False``
gives XLA's default.

With ``use_cpu_temp_blocks(mib)`` (``train.cpu_temp_block_mib``, opt-in; 16 suits glibc) the
training programs' temporaries are laid out in blocks of at most ``mib`` MiB
(``xla_multiheap_size_constraint_per_heap``) instead of one block. XLA's CPU runtime allocates
a program's temporaries with ``malloc`` on every call. glibc serves a block over its mmap
threshold (at most 32 MiB) with a fresh ``mmap`` and unmaps it when it is freed, so the
update's one 133 MB block (``scripts/bench_tunix.py``'s model) had its ~32,000 pages faulted
in and zeroed by the kernel on every call. Blocks under the threshold come from malloc's heap
and are often reused, though malloc still returns the heap's top to the kernel when enough of
it is free: from none to about a third of those faults remain, the update was 1.00-1.08x as
fast in ``scripts/bench_update.py``'s interleaved runs and rl_jax's GRPO step about 1.03x
(docs/BENCHMARKS.md, "The training programs' temporaries in blocks"). Only where buffers
live changes, not what is computed: values are bit-identical (``tests/test_compile_options.py``;
the quickstart writes the same weights). The option is off by default (0: one block, XLA's
default) for three reasons. A single buffer larger than the block keeps a block of its own,
and XLA logs a warning for it when it compiles the program. The memory plans measured on CPU
(``rl_jax.train.memory``) would change their temporaries. And JAX's persistent compilation
cache cannot store a CPU program with several blocks of temporaries (XLA does not serialize
it), so such programs compile again on a rerun or resume; the trainer says so in one line
(``uncached_note``) instead of JAX's warning per program.

Other backends get no options, nor does a jaxlib whose XLA no longer knows an option:
``_cpu_accepts`` tries each set once on a tiny program. An option that the process's
``XLA_FLAGS`` name is left to them (the test suite's ``--xla_backend_optimization_level=0``
stays -O0).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Iterable

import jax
import jax.numpy as jnp

__all__ = ["CPU_FAST_COMPILE", "CPU_TEMP_BLOCK", "CPU_XLA_REDUCTIONS", "UNCACHED_NOTE",
           "fast_compile_options", "temp_block_options", "training_options",
           "uncached_note", "use_cpu_temp_blocks", "use_cpu_xla_reductions",
           "use_fast_cpu_compile"]

# the elemental emitter, and LLVM's -O1 pipeline for the generated code (level 3 by default)
CPU_FAST_COMPILE = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 1}
# YNNPACK fuses the matmuls only (its default list has reductions too)
CPU_XLA_REDUCTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}
# the largest block of temporaries, in bytes (XLA's default: no limit, one block)
CPU_TEMP_BLOCK = "xla_multiheap_size_constraint_per_heap"
_ENABLED = [True]  # the process's setting (use_fast_cpu_compile); the config's default
_REDUCTIONS = [True]  # the process's setting (use_cpu_xla_reductions); the config's default
_TEMP_BLOCK_MIB = [0]  # the process's setting (use_cpu_temp_blocks); the config's default
# what the trainer prints once where the option meets the compilation cache; JAX's own
# warning for each such program (silenced while the option is on) starts like this
UNCACHED_NOTE = ("train.cpu_temp_block_mib: training programs whose temporaries take several "
                 "blocks are not stored in the compilation cache (XLA cannot serialize them); "
                 "they compile again on a rerun or resume")
_UNCACHEABLE = (r"Error writing persistent compilation cache entry .*"
                r"Multiple temp buffer allocations found")


def use_fast_cpu_compile(enabled: bool) -> None:
  """Whether programs made from now on in this process get ``CPU_FAST_COMPILE`` on CPU
  (``train.cpu_fast_compile``; every run's setup sets it)."""
  _ENABLED[0] = bool(enabled)


def use_cpu_xla_reductions(enabled: bool) -> None:
  """Whether training programs made from now on in this process get ``CPU_XLA_REDUCTIONS``
  on CPU (``train.cpu_xla_reductions``; every run's setup sets it)."""
  _REDUCTIONS[0] = bool(enabled)


def use_cpu_temp_blocks(mib: int) -> None:
  """The largest block of a training program's temporaries, in MiB, for programs made from now
  on in this process on CPU (``train.cpu_temp_block_mib``; every run's setup sets it; 0: one
  block, XLA's default)."""
  if isinstance(mib, bool) or not isinstance(mib, int) or mib < 0:
    raise ValueError(f"the temporaries' block must be a whole number of MiB >= 0, got {mib!r}")
  _TEMP_BLOCK_MIB[0] = mib
  if mib:  # the trainer's uncached_note says it once
    warnings.filterwarnings("ignore", message=_UNCACHEABLE, category=UserWarning)


def uncached_note(cache_dir: str | None, devices: Iterable[jax.Device]) -> str | None:
  """``UNCACHED_NOTE`` where a run with the compilation cache in ``cache_dir`` (None: off)
  compiles its training programs on ``devices`` in blocks of temporaries; else None."""
  if cache_dir is None or CPU_TEMP_BLOCK not in training_options(devices):
    return None
  return UNCACHED_NOTE


def temp_block_options(mib: int) -> dict:
  """The compiler options that cap a program's blocks of temporaries at ``mib`` MiB (none for
  0)."""
  return {CPU_TEMP_BLOCK: mib << 20} if mib else {}


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
  """The ``compiler_options`` of the sampler's prefill on ``devices``, and part of every
  training program's (``training_options``): ``CPU_FAST_COMPILE`` when
  ``use_fast_cpu_compile`` is on, the devices are all CPU devices and the compiler takes
  them; else none."""
  return _cpu_options(devices, CPU_FAST_COMPILE if _ENABLED[0] else {})


def training_options(devices: Iterable[jax.Device]) -> dict:
  """The ``compiler_options`` of a training program (the update, the log-prob and value
  passes, the SFT step) on ``devices``: ``fast_compile_options``, ``CPU_XLA_REDUCTIONS``
  when ``use_cpu_xla_reductions`` is on, and the temporaries' block of
  ``use_cpu_temp_blocks`` when it is not 0, where the devices are all CPU devices and the
  compiler takes them."""
  devices = list(devices)
  reductions = _cpu_options(devices, CPU_XLA_REDUCTIONS if _REDUCTIONS[0] else {})
  blocks = _cpu_options(devices, temp_block_options(_TEMP_BLOCK_MIB[0]))
  return {**fast_compile_options(devices), **reductions, **blocks}


def _cpu_options(devices: Iterable[jax.Device], options: dict) -> dict:
  """``options`` where every device is a CPU device and the compiler takes them, less those
  the process's ``XLA_FLAGS`` name (the user's flag wins); else none."""
  named = {f.split("=", 1)[0].lstrip("-") for f in os.environ.get("XLA_FLAGS", "").split()}
  options = {k: v for k, v in options.items() if k not in named}
  if not options or any(d.platform != "cpu" for d in devices):
    return {}
  items = tuple(sorted(options.items()))
  return dict(items) if _cpu_accepts(items) else {}
