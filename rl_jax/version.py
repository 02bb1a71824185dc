"""The versions in use, CI-safe (no accelerator needed): ``python -m rl_jax.version``.

Prints rl_jax, jax, jaxlib, Python and the default JAX backend; ``TESTED_JAX`` is the jax
release the test suite was last run against (setup.py allows newer releases).
"""

from __future__ import annotations

import platform

import jax
import jaxlib

import rl_jax

__all__ = ["TESTED_JAX", "versions", "report"]

TESTED_JAX = "0.10.2"


def versions() -> dict[str, str]:
  """``{"rl_jax", "jax", "jaxlib", "python", "backend"}`` -> version strings."""
  return {"rl_jax": rl_jax.__version__, "jax": jax.__version__,
          "jaxlib": jaxlib.__version__, "python": platform.python_version(),
          "backend": jax.default_backend()}


def report() -> str:
  """One line, e.g. ``rl_jax 0.1.0 | jax 0.10.2 (tested: 0.10.2) | jaxlib ... | cpu``."""
  v = versions()
  return (f"rl_jax {v['rl_jax']} | jax {v['jax']} (tested: {TESTED_JAX}) | "
          f"jaxlib {v['jaxlib']} | python {v['python']} | backend {v['backend']}")


if __name__ == "__main__":
  print(report())
