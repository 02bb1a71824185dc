"""``python -m tests.multiprocess_main ARGS`` runs ``python -m rl_jax.train ARGS`` (the same
``main``) for the multi-process tests, with one change to how JAX caches programs.

JAX keys a persistent-cache entry by the process's own devices (the CPU topology of each
process differs) and writes entries from process 0 only, so every other process compiled
every program of every launch. Here the key covers the job's global device list instead,
which is the same in every process, and process 0 hands each program it compiles to the
others (``jax_share_binary_between_hosts``, the same executable in every process, as on a
cluster). Every process then loads what process 0 compiled in an earlier launch.
"""

import jax
from jax._src import cache_key

from rl_jax.train import loop


def _hash_global_devices(hash_obj, devices) -> None:
  for d in devices.flat:
    cache_key._hash_string(hash_obj, f"{d.device_kind}:{d.id}:{d.process_index}")  # pylint: disable=protected-access


if __name__ == "__main__":
  if hasattr(cache_key, "_hash_accelerator_config") and hasattr(cache_key, "_hash_string"):
    cache_key._hash_accelerator_config = _hash_global_devices  # pylint: disable=protected-access
    jax.config.update("jax_share_binary_between_hosts", True)
  loop.main()
