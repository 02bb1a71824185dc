"""Tools: the calculator, the Python sandbox's failure modes (each an error observation with a
kind, never an exception), and the call wrapper."""

import os
import time

import pytest

from rl_jax.envs.tools import Calculator, PythonSandbox, ToolError, call_tool


@pytest.fixture(scope="module")
def box():
  return PythonSandbox(timeout_s=1.0, memory_bytes=256 * 2**20, max_output_bytes=2000)


@pytest.mark.parametrize("expr,out", [("12*34", "408"), ("2**10 - 1", "1023"), ("7/2", "3.5"),
                                      ("-(3+4)*2", "-14"), ("10/4*2", "5"), ("7//2 + 7%2", "4"),
                                      (" 123 * 456 ", "56088")])
def test_calculator(expr, out):
  assert Calculator()(expr) == out


@pytest.mark.parametrize("expr,kind", [("1/0", "exception"), ("__import__('os')", "bad_arguments"),
                                       ("2**100000", "bad_arguments"), ("1+", "bad_arguments"),
                                       ("x*2", "bad_arguments"), ("9" * 300, "bad_arguments"),
                                       ("10**60*10**60", "bad_arguments"), ("'a'*3", "bad_arguments")])
def test_calculator_errors(expr, kind):
  out = Calculator()(expr)
  assert isinstance(out, ToolError) and out.kind == kind and out.startswith(f"error[{kind}]")


def test_sandbox_runs_code_in_a_fresh_directory_that_is_removed(box):
  out = box("import os\nprint(6*7)\nprint(os.getcwd())\nopen('f.txt', 'w').write('x')")
  assert not isinstance(out, ToolError)
  value, cwd = out.split()
  assert value == "42" and not os.path.exists(cwd)


@pytest.mark.parametrize("code,kind", [
    ("raise ValueError('boom')", "exception"),
    ("import sys; sys.exit(3)", "exception"),
    ("while True:\n  pass", "timeout"),
    ("import time; time.sleep(60)", "timeout"),
    ("print('x' * 3_000_000)", "output_limit"),
    ("print('y' * 5000)", "output_limit"),
    ("while True:\n  print('spam' * 100)", "output_limit"),
    ("import sys; sys.stdout.buffer.write(b'ok \\xff\\xfe end')", "non_utf8"),
    ("x = bytearray(8 * 2**30)", "memory"),
    ("x = [0] * (2**31)", "memory"),
    ("import socket; socket.socket()", "network"),
    ("import socket; socket.create_connection(('127.0.0.1', 9))", "network"),
    ("import urllib.request; urllib.request.urlopen('http://127.0.0.1:9')", "network"),
])
def test_sandbox_failure_modes(box, code, kind):
  start = time.monotonic()
  out = box(code)
  assert isinstance(out, ToolError), out
  assert out.kind == kind, out
  assert time.monotonic() - start < 5
  assert len(out.encode()) < 4000


def test_sandbox_kills_background_children(box):
  code = ("import subprocess, sys\n"
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
          "print('parent done')")
  start = time.monotonic()
  out = box(code)
  assert time.monotonic() - start < 1.0
  assert out == "parent done\n"


def test_sandbox_non_utf8_decoded_with_replacement(box):
  out = box("import sys; sys.stdout.buffer.write(b'a\\xffb')")
  assert out.kind == "non_utf8" and "a\ufffdb" in out


def test_call_tool_never_raises():
  tools = {"calc": Calculator()}
  assert call_tool(tools, "calc", {"expr": "2*3"}) == "6"
  assert call_tool(tools, "nope", {}).kind == "unknown_tool"
  assert call_tool(tools, "calc", {"exp": "1"}).kind == "bad_arguments"
  assert call_tool(tools, "calc", {"expr": "1", "x": 2}).kind == "bad_arguments"
  assert call_tool(tools, "calc", ["1"]).kind == "bad_arguments"
  assert call_tool(tools, "calc", {"expr": 5}).kind == "bad_arguments"

  def broken(**_):
    raise RuntimeError("inside")
  assert call_tool({"b": broken}, "b", {}).kind == "exception"
  assert call_tool({"n": lambda: 3}, "n", {}) == "3"


def test_tool_error_kinds_are_checked():
  with pytest.raises(ValueError):
    ToolError("whatever")
  assert ToolError("timeout") == "error[timeout]"
