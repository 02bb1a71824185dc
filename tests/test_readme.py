"""README's two set-up commands: CI runs the test command verbatim; the quickstart command
names the config and entry point that exist."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _commands():
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def test_readme_has_exactly_two_commands_and_ci_runs_the_test_one():
  commands = _commands()
  assert len(commands) == 2
  quickstart, tests = commands
  with open(os.path.join(ROOT, ".ci", "run")) as f:
    lines = f.read().splitlines()
  assert tests in lines
  # and the slow tests the README's command leaves out (tests/conftest.py, SLOW_TESTS)
  assert lines[-1] == "python -m pytest -q -n 2 -m slow tests", lines[-1]
  assert "python -m rl_jax.train --config=configs/quickstart.py --workdir=" in quickstart
  assert os.path.exists(os.path.join(ROOT, "configs", "quickstart.py"))


def test_every_slow_test_named_in_conftest_exists():
  """Each ``SLOW_TESTS`` entry names a test function of a test file (a renamed test would
  otherwise silently return to the README's command)."""
  from tests import conftest
  for entry in conftest.SLOW_TESTS:
    name, _, func = entry.partition("::")
    func = func.split("[", 1)[0]
    path = os.path.join(ROOT, "tests", name)
    assert os.path.exists(path), entry
    with open(path) as f:
      assert re.search(rf"^def {re.escape(func)}\(", f.read(), flags=re.M), entry
