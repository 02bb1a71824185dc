"""The suite's xdist scheduler (``tests/conftest.py``) when a worker dies mid-run.

A worker that aborts (a C++ fault in a compiled program, say) must fail the test it was
running and let the run finish; xdist's own file scheduler hangs when the dead worker had
finished files, which turns one red test into a CI run that never ends.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _write_suite(directory):
  (directory / "conftest.py").write_text(textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {str(ROOT)!r})
      from tests.conftest import pytest_xdist_make_scheduler  # the hook under test
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
          if {last} and not pathlib.Path({str(flag)!r}).exists():
            pathlib.Path({str(flag)!r}).touch()
            os.abort()
        def test_d(): pass
        """))


def test_a_crashed_worker_fails_its_test_and_the_run_finishes(tmp_path):
  _write_suite(tmp_path)
  env = dict(os.environ, PYTHONFAULTHANDLER="0")
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
       "--rootdir", str(tmp_path), str(tmp_path)],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  summary = proc.stdout.strip().splitlines()[-1]
  assert proc.returncode == 1, proc.stdout[-3000:]
  assert "crashed while running 'test_file3.py::test_c'" in proc.stdout
  # Every other test ran once, test_d of the crashed file on the replacement worker.
  assert "1 failed, 15 passed" in summary, proc.stdout[-3000:]
