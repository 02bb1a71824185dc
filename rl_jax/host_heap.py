"""Large host blocks reused instead of faulted in again (glibc, CPU backend; opt-in).

XLA's CPU runtime allocates the temporaries of a program call as one block and frees it when
the call ends: 134 MiB for the RL update of ``scripts/bench_tunix.py``'s 3.7M-parameter policy
at 16 x 64 tokens. glibc's malloc serves a block that large with a fresh ``mmap`` and hands it
back with ``munmap`` (its mmap threshold is at most 32 MiB, and a worker thread's arena cannot
hold such a block at all), so every call faults all of the block's pages in again: about
35,000 page faults per update on that model, 10–15% of the update's time.

``reuse_large_blocks`` (what ``--config.train.host_heap_reuse=True`` does when the CLI starts)
keeps those blocks in the process:

* JAX runs single-device CPU programs on the calling thread
  (``jax_cpu_enable_async_dispatch=False``), so their blocks come from glibc's main arena,
  the one arena that can hold them;
* the main arena serves large blocks from its own heap (``M_MMAP_MAX=0``) and keeps up to
  ``keep_bytes`` free at its top for the next call (``M_TRIM_THRESHOLD``).

The first takes effect only before the process's first JAX computation, so the CLI applies it
before building the run, and a script calls ``reuse_large_blocks()`` before anything else.
Values are unchanged (the same programs run; only where their memory comes from changes).
The resident set keeps up to ``keep_bytes`` of freed memory; the learner's
``release_host_memory`` before each update of a large policy still hands free pages back.
Where the C library is not glibc nothing changes (``reuse_large_blocks`` returns False).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import jax
from jax._src import xla_bridge

__all__ = ["KEEP_BYTES", "reuse_large_blocks", "reusing"]

KEEP_BYTES = 1 << 30  # free memory the heap keeps at its top for the next call
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_STATE = {"on": False}


@functools.cache
def _glibc_mallopt():
  """glibc's ``mallopt``, or None where the C library is not glibc."""
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "gnu_get_libc_version"):
      return None
    return libc.mallopt
  except (OSError, AttributeError, TypeError):
    return None


def reuse_large_blocks(keep_bytes: int = KEEP_BYTES) -> bool:
  """Keeps XLA's per-call host blocks for reuse (module docstring); True once applied, False
  where there is no glibc.

  Raises:
    RuntimeError: JAX has already run a computation in this process (too late to move the
      programs' allocations to the calling thread).
  """
  mallopt = _glibc_mallopt()
  if mallopt is None:
    return False
  if _STATE["on"]:
    return True
  if _backends_initialized():
    raise RuntimeError("train.host_heap_reuse must be applied before the process's first JAX "
                       "computation: call rl_jax.host_heap.reuse_large_blocks() first, or "
                       "start the run with python -m rl_jax.train")
  if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, int(keep_bytes))):
    return False
  jax.config.update("jax_cpu_enable_async_dispatch", False)
  _STATE["on"] = True
  return True


def _backends_initialized() -> bool:
  """Whether JAX has created its backends (it has computed, or listed devices)."""
  known = getattr(xla_bridge, "backends_are_initialized", None)
  return known() if known is not None else bool(getattr(xla_bridge, "_backends", {}))


def reusing() -> bool:
  """Whether ``reuse_large_blocks`` has been applied in this process."""
  return _STATE["on"]
