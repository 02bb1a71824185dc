"""Tools: a safe calculator, a subprocess Python sandbox, and a call wrapper that never raises.

Every failure becomes an observation the model reads: a ``ToolError``, which is a ``str``
("error[kind]: message") that also carries its ``kind`` for metrics. Kinds: "timeout",
"exception", "output_limit", "memory", "non_utf8", "network", "bad_json", "bad_call",
"bad_arguments", "unknown_tool", "too_many_calls".

``PythonSandbox`` isolation is best-effort, meant to contain accidents of a model's code
(infinite loops, huge prints, memory bombs, stray network calls), not a security boundary
against malicious code: the child runs as the same user, can read the filesystem, and a
determined program can undo the in-process network block. Run untrusted workloads in a
container or VM.
"""

from __future__ import annotations

import ast
import inspect
import math
import operator
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Mapping

__all__ = ["ERROR_KINDS", "Calculator", "PythonSandbox", "ToolError", "call_tool"]

ERROR_KINDS = ("timeout", "exception", "output_limit", "memory", "non_utf8", "network",
               "bad_json", "bad_call", "bad_arguments", "unknown_tool", "too_many_calls")


class ToolError(str):
  """An error observation: the text ``"error[kind]: message"`` with ``.kind`` and
  ``.message`` attributes."""

  kind: str
  message: str

  def __new__(cls, kind: str, message: str = "") -> "ToolError":
    if kind not in ERROR_KINDS:
      raise ValueError(f"unknown tool error kind {kind!r}")
    text = f"error[{kind}]: {message}" if message else f"error[{kind}]"
    self = super().__new__(cls, text)
    self.kind, self.message = kind, message
    return self


def call_tool(tools: Mapping[str, Any], name: str, arguments: Any) -> str:
  """Run ``tools[name](**arguments)``; any failure is returned as a ``ToolError``.

  Args:
    tools: tools by name.
    name: the called tool.
    arguments: the parsed arguments (must be a mapping with string keys).

  Returns:
    The tool's output text, or a ``ToolError`` (unknown tool, arguments that do not fit the
    tool's signature, an exception inside the tool).
  """
  tool = tools.get(name)
  if tool is None:
    return ToolError("unknown_tool", f"no tool {name!r}; tools: {', '.join(sorted(tools))}")
  if not isinstance(arguments, Mapping) or not all(isinstance(k, str) for k in arguments):
    return ToolError("bad_arguments", "arguments must be an object")
  try:
    inspect.signature(tool).bind(**arguments)
  except TypeError as e:
    return ToolError("bad_arguments", str(e))
  except ValueError:  # no signature available: let the call decide
    pass
  try:
    out = tool(**arguments)
  except Exception as e:  # pylint: disable=broad-except
    return ToolError("exception", f"{type(e).__name__}: {e}")
  return out if isinstance(out, str) else str(out)


# -- calculator --

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator:
  """Arithmetic on numbers with + - * / // % ** and parentheses, evaluated by walking the
  ``ast`` (no ``eval``). Integers stay exact; floats print with up to 10 significant digits.

  Limits keep it cheap: expression length, exponent size and result magnitude.
  """

  description = "Evaluate an arithmetic expression, e.g. 12*(3+4)."
  parameters = {"type": "object", "properties": {"expr": {"type": "string"}},
                "required": ["expr"]}

  def __init__(self, name: str = "calc", max_len: int = 200, max_exponent: int = 64,
               max_abs: float = 1e100):
    self.name = name
    self.max_len, self.max_exponent, self.max_abs = max_len, max_exponent, max_abs

  def __call__(self, expr: str) -> str:
    if not isinstance(expr, str):
      return ToolError("bad_arguments", "expr must be a string")
    if len(expr) > self.max_len:
      return ToolError("bad_arguments", f"expression longer than {self.max_len} characters")
    try:
      tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError):
      return ToolError("bad_arguments", "not an arithmetic expression")
    try:
      value = self._eval(tree.body)
    except ZeroDivisionError:
      return ToolError("exception", "division by zero")
    except (ValueError, OverflowError, TypeError) as e:
      return ToolError("bad_arguments", str(e))
    return _format_number(value)

  def _eval(self, node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
      return _UNOPS[type(node.op)](self._eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
      left, right = self._eval(node.left), self._eval(node.right)
      if isinstance(node.op, ast.Pow) and abs(right) > self.max_exponent:
        raise ValueError(f"exponent larger than {self.max_exponent}")
      out = _BINOPS[type(node.op)](left, right)
      if isinstance(out, complex) or abs(out) > self.max_abs:
        raise ValueError("result out of range")
      return out
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def _format_number(value: int | float) -> str:
  if isinstance(value, float):
    if not math.isfinite(value):
      return ToolError("bad_arguments", "result is not finite")
    if value.is_integer() and abs(value) < 1e15:
      return str(int(value))
    return format(value, ".10g")
  return str(value)


# -- python sandbox --

# Runs in the child before the user's code: resource limits, then the network block.
_BOOTSTRAP = """
import resource, runpy, socket, sys
def _lim(which, value):
  try:
    soft, hard = resource.getrlimit(which)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))
  except (ValueError, OSError):
    pass
cpu, mem, fsize, nproc = (int(v) for v in sys.argv[1:5])
_lim(resource.RLIMIT_CPU, cpu)
_lim(resource.RLIMIT_AS, mem)
_lim(resource.RLIMIT_FSIZE, fsize)
_lim(resource.RLIMIT_CORE, 0)
if nproc > 0:
  _lim(resource.RLIMIT_NPROC, nproc)
class NetworkDisabledError(OSError):
  pass
def _no_network(*args, **kwargs):
  raise NetworkDisabledError("network access is disabled in the sandbox")
import _socket
class _NoSocket(socket.socket):
  def __init__(self, *args, **kwargs):
    _no_network()
class _NoRawSocket(_socket.socket):
  def __init__(self, *args, **kwargs):
    _no_network()
socket.socket, _socket.socket = _NoSocket, _NoRawSocket
for _mod in (socket, _socket):
  for _name in ("create_connection", "socketpair", "fromfd", "getaddrinfo"):
    if hasattr(_mod, _name):
      setattr(_mod, _name, _no_network)
del _mod, _name, _lim
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""


class PythonSandbox:
  """Run Python code in a fresh subprocess and return what it prints (stdout and stderr).

  Per call: a new temporary working directory (deleted afterwards), ``sys.executable -I``
  (isolated mode: no user site, no PYTHON* variables), a minimal environment (no proxies),
  ``RLIMIT_CPU``, ``RLIMIT_AS`` (memory), ``RLIMIT_FSIZE`` and, when ``max_processes`` is set,
  ``RLIMIT_NPROC`` (it counts all of the user's processes, so it is off by default), a
  wall-clock time-out that kills the whole process group, output capped at
  ``max_output_bytes``, and socket creation replaced by a function that raises. Best-effort
  only (module docstring).
  """

  description = "Run a Python program and return its printed output."
  parameters = {"type": "object", "properties": {"code": {"type": "string"}},
                "required": ["code"]}

  def __init__(self, name: str = "python", timeout_s: float = 5.0,
               memory_bytes: int = 512 * 2**20, max_output_bytes: int = 4096,
               max_file_bytes: int = 16 * 2**20, max_processes: int | None = None):
    self.name = name
    self.timeout_s, self.memory_bytes = timeout_s, memory_bytes
    self.max_output_bytes, self.max_file_bytes = max_output_bytes, max_file_bytes
    self.max_processes = max_processes

  def __call__(self, code: str) -> str:
    if not isinstance(code, str):
      return ToolError("bad_arguments", "code must be a string")
    workdir = tempfile.mkdtemp(prefix="rl_jax_sandbox_")
    try:
      return self._run(code, workdir)
    except OSError as e:  # could not start the child
      return ToolError("exception", f"sandbox failed to start: {e}")
    finally:
      shutil.rmtree(workdir, ignore_errors=True)

  def _run(self, code: str, workdir: str) -> str:
    with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8",
              errors="surrogatepass") as f:
      f.write(code)
    cpu = max(1, math.ceil(self.timeout_s) + 1)
    argv = [sys.executable, "-I", "-c", _BOOTSTRAP, str(cpu), str(self.memory_bytes),
            str(self.max_file_bytes), str(self.max_processes or 0)]
    env = {"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LC_ALL": "C.UTF-8",
           "LANG": "C.UTF-8"}
    proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    cap = max(16 * self.max_output_bytes, 2**20)
    try:
      out, timed_out, overflow = _read_limited(proc, self.timeout_s, cap)
    finally:
      _kill_group(proc)
      proc.stdout.close()
    return _observation(out, proc.returncode, timed_out, overflow, self)


def _read_limited(proc: subprocess.Popen, timeout_s: float,
                  limit: int) -> tuple[bytes, bool, bool]:
  """Read the child's output until EOF, the child's exit, the deadline or ``limit`` bytes.

  Returns (output, timed out, over ``limit``)."""
  deadline = time.monotonic() + timeout_s
  fd = proc.stdout.fileno()
  buf = bytearray()
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      return bytes(buf), True, False
    exited = proc.poll() is not None
    ready, _, _ = select.select([fd], [], [], 0.0 if exited else min(left, 0.05))
    if not ready:
      if exited:  # done; a background child may still hold the pipe open
        break
      continue
    chunk = os.read(fd, 65536)
    if not chunk:
      break
    buf += chunk
    if len(buf) > limit:
      return bytes(buf), False, True
  try:
    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
  except subprocess.TimeoutExpired:
    return bytes(buf), True, False
  return bytes(buf), False, False


def _kill_group(proc: subprocess.Popen):
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  proc.wait()


def _tail(text: str, n: int = 600) -> str:
  return text if len(text) <= n else "..." + text[-n:]


def _observation(out: bytes, rc: int | None, timed_out: bool, overflow: bool,
                 box: PythonSandbox) -> str:
  """Classify a finished run into output text or a ``ToolError``.

  A failing run is classified by its error (its output's tail kept); a run that printed more
  than ``max_output_bytes`` (or so much that it was stopped) gives "output_limit" with the
  head of its output."""
  if overflow:
    return _over_limit(out, box.max_output_bytes)
  text = out.decode("utf-8", errors="replace")
  if timed_out or rc == -signal.SIGXCPU:
    return ToolError("timeout", f"time limit {box.timeout_s:g} s exceeded"
                     + (f"; output:\n{_tail(text)}" if text else ""))
  if rc and "NetworkDisabledError" in text:
    return ToolError("network", _tail(text))
  if rc and ("MemoryError" in text or rc == -signal.SIGKILL):
    return ToolError("memory", f"memory limit {box.memory_bytes // 2**20} MiB exceeded\n"
                     + _tail(text, 200))
  if rc:
    why = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
    return ToolError("exception", f"{why}\n{_tail(text)}")
  if len(out) > box.max_output_bytes:
    return _over_limit(out, box.max_output_bytes)
  try:
    out.decode("utf-8")
  except UnicodeDecodeError:
    return ToolError("non_utf8", "output is not valid UTF-8 (replaced):\n" + text)
  return text


def _over_limit(out: bytes, limit: int) -> ToolError:
  head = out[:limit].decode("utf-8", errors="replace")
  return ToolError("output_limit", f"output over {limit} bytes, truncated:\n{head}")
