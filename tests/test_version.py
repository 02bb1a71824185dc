"""``python -m rl_jax.version`` reports the versions in use (no accelerator needed), and
setup.py's jax floor is the tested release."""

import os
import re
import subprocess
import sys

import jax

from rl_jax import version
from tests.tiny import ROOT


def test_version_command_prints_jax_in_use_and_tested():
  out = subprocess.run([sys.executable, "-m", "rl_jax.version"], cwd=ROOT, check=True,
                       capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT)).stdout
  assert f"jax {jax.__version__} (tested: {version.TESTED_JAX})" in out
  assert version.versions()["backend"] in out


def test_setup_py_jax_floor_is_the_tested_release():
  setup = open(os.path.join(ROOT, "setup.py")).read()
  (spec,) = re.findall(r'"jax(>=[^"]*)"', setup)
  assert spec == f">={version.TESTED_JAX}"
