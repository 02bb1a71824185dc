"""``python -m tests.multiprocess_main ARGS [--then ARGS ...]`` runs ``python -m rl_jax.train
ARGS`` (the same ``main``) for the multi-process tests, then each later run's ARGS in the same
processes (one start-up and one ``jax.distributed`` job for several runs), with one change to
how JAX caches programs.

JAX keys a persistent-cache entry by the process's own devices (the CPU topology of each
process differs) and writes entries from process 0 only, so every other process compiled
every program of every launch. Here the key covers the program's device list instead (the
same in every process for a program over the job's devices), process 0 hands each such
program it compiles to the others (``jax_share_binary_between_hosts``: the same executable in
every process, as on a cluster), and every process writes the entries of the programs on its
own devices only. A later launch then loads every program of every process.
"""

import sys

import jax
from jax._src import cache_key, compilation_cache, compiler, distributed

from rl_jax import config_utils
from rl_jax.train import loop

_write = getattr(compiler, "_cache_write", None)


def _hash_devices(hash_obj, devices) -> None:
  for d in devices.flat:
    cache_key._hash_string(hash_obj, f"{d.device_kind}:{d.id}:{d.process_index}")  # pylint: disable=protected-access


def _cache_write(cache_key_, compile_time_secs, module_name, backend, executable,
                 host_callbacks) -> None:
  if distributed.global_state.process_id == 0 or host_callbacks:
    _write(cache_key_, compile_time_secs, module_name, backend, executable, host_callbacks)
  else:  # a program on this process's devices only (the others come from process 0)
    compilation_cache.put_executable_and_time(cache_key_, module_name, executable, backend,
                                              int(compile_time_secs))


def _runs(argv: list[str]) -> list[list[str]]:
  """``argv`` cut at each ``--then``: the command line of each run (program name first)."""
  runs = [[argv[0]]]
  for a in argv[1:]:
    if a == "--then":
      runs.append([argv[0]])
    else:
      runs[-1].append(a)
  return runs


if __name__ == "__main__":
  # (a JAX without these internals runs unchanged: every process compiles, as before)
  if _write is not None and hasattr(cache_key, "_hash_accelerator_config"):
    cache_key._hash_accelerator_config = _hash_devices  # pylint: disable=protected-access
    compiler._cache_write = _cache_write  # pylint: disable=protected-access
    jax.config.update("jax_share_binary_between_hosts", True)
  first, *later = _runs(sys.argv)
  loop.main(first)
  for argv in later:  # the job is joined already: train only
    config_utils.main_guard(lambda a: loop.train(*config_utils.parse_cli(a)))(argv)
