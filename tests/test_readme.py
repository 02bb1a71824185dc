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
