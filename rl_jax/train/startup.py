"""Start-up and step-time instruments: the persistent compilation cache, a clock of time
spent compiling, and a profiler trace of one step.

* ``use_compile_cache(path, workdir)``: JAX's persistent compilation cache in ``path``
  (relative paths are under the workdir, so a rerun or resume of the same run loads its
  programs instead of compiling them; an absolute path can be shared by several runs; ""
  disables it). Every program is cached, however fast it compiled.
* ``CompileClock``: seconds spent tracing, lowering and compiling (or loading from the cache)
  jitted programs, from ``jax.monitoring`` events; the loop reports it per step as
  ``compile_time_s``.
* ``start_profile`` / ``stop_profile``: a ``jax.profiler`` trace of one step into
  ``DIR/profile`` (TensorBoard's profile plugin, or Perfetto: ``*.trace.json.gz``) and its
  per-program, per-op summary ``DIR/profile/summary.txt`` (``rl_jax.profiling``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

import jax
from jax.experimental.compilation_cache import compilation_cache

from rl_jax import profiling, storage

__all__ = ["COMPILE_EVENTS", "CompileClock", "compile_clock", "use_compile_cache",
           "cache_dir", "start_profile", "stop_profile"]

# jax.monitoring duration events that together make up the time to get a jitted program:
# tracing to a jaxpr, lowering to StableHLO, and the backend compile (or cache load).
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


class CompileClock:
  """Accumulates the durations of ``COMPILE_EVENTS`` (seconds, all threads)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.total = 0.0
    self._taken = 0.0

  def record(self, event: str, duration: float, **_) -> None:
    if event in COMPILE_EVENTS:
      with self._lock:
        self.total += duration

  def take(self) -> float:
    """Seconds recorded since the previous ``take``."""
    with self._lock:
      out, self._taken = self.total - self._taken, self.total
    return out


_CLOCK: CompileClock | None = None


def compile_clock() -> CompileClock:
  """The process's clock (its listener is registered once, on first use)."""
  global _CLOCK
  if _CLOCK is None:
    _CLOCK = CompileClock()
    jax.monitoring.register_event_duration_secs_listener(_CLOCK.record)
  return _CLOCK


def cache_dir(path: str, workdir: str) -> str | None:
  """The cache directory for config value ``path`` (None: disabled)."""
  if not path:
    return None
  path = os.path.expanduser(path)
  if storage.is_remote(path) or (storage.is_remote(workdir) and not os.path.isabs(path)):
    return path if storage.is_remote(path) else storage.join(workdir, path)
  return os.path.abspath(os.path.join(workdir, path))


def use_compile_cache(path: str, workdir: str) -> str | None:
  """Points JAX's persistent compilation cache at ``cache_dir(path, workdir)`` (or turns it
  off for ""), caching every program; returns the directory."""
  directory = cache_dir(path, workdir)
  if directory is not None:
    storage.makedirs(directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  if jax.config.jax_compilation_cache_dir != directory:
    jax.config.update("jax_compilation_cache_dir", directory)
    compilation_cache.reset_cache()  # the cache is bound on first use; rebind it
  return directory


def start_profile(workdir: str) -> str:
  """Starts a ``jax.profiler`` trace into ``workdir/profile`` (a ``gs://`` workdir: into a
  local temporary directory, which ``stop_profile`` uploads there); returns the directory."""
  if storage.is_remote(workdir):
    directory = tempfile.mkdtemp(prefix="rl_jax_profile_")
  else:
    directory = os.path.join(workdir, "profile")
    os.makedirs(directory, exist_ok=True)
  jax.profiler.start_trace(directory, create_perfetto_trace=True)
  return directory


def stop_profile(directory: str, *wait_for, upload_to: str | None = None) -> str:
  """Waits for ``wait_for`` (pytrees of arrays) to be computed, stops the trace, and writes
  its summary to ``directory/summary.txt``; returns the summary. ``upload_to``: a
  ``gs://`` directory that receives ``directory``'s files (the local copy is then deleted)."""
  jax.block_until_ready(wait_for)
  jax.profiler.stop_trace()
  summary = profiling.summarize(directory)
  with open(os.path.join(directory, "summary.txt"), "w") as f:
    f.write(summary)
  if upload_to is not None:
    storage.upload_dir(directory, upload_to)
    shutil.rmtree(directory, ignore_errors=True)
  return summary
