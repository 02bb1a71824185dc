"""Test session setup: 8 fake CPU devices (for mesh tests) and float32 matmuls everywhere."""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# One persistent compilation cache for every training run of the session (the xdist workers,
# the subprocess runs and the notebook kernel inherit it): the many tiny runs share programs.
# A loaded program is the compiled one, so results are unchanged; train.compile_cache set by a
# test still wins.
if "RL_JAX_COMPILE_CACHE" not in os.environ:
  os.environ["RL_JAX_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="rl_jax_test_compile_cache_")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
