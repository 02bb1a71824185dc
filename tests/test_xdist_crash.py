"""The suite's xdist scheduler (``tests/conftest.py``) when a worker dies mid-run.

A worker that aborts (a C++ fault in the compiler, say) must not end the run: its test runs
once more on a new worker and fails if it aborts again, and the other tests run once each.
xdist's own file scheduler hangs when the dead worker had finished files, which turns one
red test into a CI run that never ends.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _write_suite(directory, always, hang=False):
  (directory / "conftest.py").write_text(textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {str(ROOT)!r})
      from tests.conftest import (  # the hooks under test
          pytest_handlecrashitem, pytest_report_teststatus, pytest_xdist_make_scheduler)
      """))
  flag = directory / "aborted_once"
  for i in range(4):
    # The last file is the long one and aborts its worker once, after the other worker has
    # finished its files: the case where xdist's scheduler re-queued finished files.
    last = i == 3
    (directory / f"test_file{i}.py").write_text(textwrap.dedent(f"""
        import os, pathlib, time
        def test_a(): time.sleep({1.5 if last else 0.1})
        def test_b(): time.sleep(0.1)
        def test_c():
          if {last} and ({always} or not pathlib.Path({str(flag)!r}).exists()):
            pathlib.Path({str(flag)!r}).touch()
            time.sleep(60) if {hang} else os.abort()
        def test_d(): pass
        """))


def _run_suite(directory, *options):
  env = dict(os.environ, PYTHONFAULTHANDLER="0")
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
       "--rootdir", str(directory), *options, str(directory)],
      cwd=directory, env=env, capture_output=True, text=True, timeout=300)
  return proc, proc.stdout.strip().splitlines()[-1]


def test_a_test_that_crashes_its_worker_once_runs_again_and_the_run_finishes(tmp_path):
  _write_suite(tmp_path, always=False)
  proc, summary = _run_suite(tmp_path)
  assert proc.returncode == 0, proc.stdout[-3000:]
  assert "crashed while running 'test_file3.py::test_c'; running it again" in proc.stdout
  # Every test passed once, test_c and test_d of the crashed file on the replacement worker.
  assert "16 passed, 1 rerun" in summary, proc.stdout[-3000:]


def test_a_test_that_crashes_its_worker_twice_fails_and_the_run_finishes(tmp_path):
  _write_suite(tmp_path, always=True)
  proc, summary = _run_suite(tmp_path)
  assert proc.returncode == 1, proc.stdout[-3000:]
  assert "crashed while running 'test_file3.py::test_c'" in proc.stdout
  assert "1 failed, 15 passed, 1 rerun" in summary, proc.stdout[-3000:]


def test_a_test_that_hangs_is_stopped_with_its_stacks_and_fails(tmp_path):
  """pytest.ini's time-outs, shortened: the stacks are printed, the worker exits, the test runs
  once more and fails, and the run finishes."""
  _write_suite(tmp_path, always=True, hang=True)
  proc, summary = _run_suite(tmp_path, "-o", "faulthandler_timeout=2", "-o", "timeout=4",
                             "-o", "timeout_method=thread")
  assert proc.returncode == 1, proc.stdout[-3000:]
  assert "crashed while running 'test_file3.py::test_c'" in proc.stdout
  assert "in test_c" in proc.stdout + proc.stderr  # the faulthandler's stack of the hung test
  assert "1 failed, 15 passed, 1 rerun" in summary, proc.stdout[-3000:]
