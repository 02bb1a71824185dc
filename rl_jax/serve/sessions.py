"""Training agents that call the server: each episode is a *session* of the user's agent
function, run against the live policy through ``/s/{session}/v1/chat/completions``.

``env.agent=module:fn`` makes every episode of the task an ``AgentSession``, an environment
of the multi-turn engine (``rollout.AgentEngine``) whose other side is an HTTP client:

* ``reset(example)`` starts ``fn(base_url, api_key, example)`` in a thread, with
  ``base_url = http://127.0.0.1:PORT/s/{session}/v1`` (an unmodified OpenAI client needs
  nothing else), and waits for the agent's first request: its messages (and tools) are the
  episode's opening prompt.
* The engine samples the turn with the run's rollout settings and calls ``step(text)``: the
  pending request is answered (tool calls parsed as the server does), and ``step`` waits for
  what the agent does next. Its next request must repeat the conversation so far (the same
  messages, our answer as we returned it) and add new messages; those become the turn's
  observation, appended as ids (``renderer.delta_ids``) after the sampled ids, which are kept
  exactly as sampled (token in, token out). When ``fn`` returns, the episode ends with its
  return value as the reward.
* A request whose messages rewrite the conversation is answered 400 and ends the episode
  (reward 0, counted in ``session_rewrites``); an agent function that raises ends its episode
  the same way (``agent_errors``); the run goes on. A request with its own ``temperature``,
  ``top_p``, ``top_k``, ``seed``, ``n`` > 1, ``stream`` or ``logprobs`` is answered 400: a
  training session samples as the run does, so that a resumed run is exact.

Everything else is the engine's, as for in-process environments: random streams keyed by
(group, sample, token index), per-token policy versions, the staleness bound, held groups
and their resume by replay (the agent is restarted and its requests answered with the
recorded turns; this needs an agent that is deterministic given the example and the
answers it gets).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import json
import logging
import math
import queue
import secrets
import socket
import threading
import time
from typing import Callable

from rl_jax.envs.base import Message, StepResult
from rl_jax.envs import tool_calls
from rl_jax.errors import ConfigError
from rl_jax.serve.protocol import ApiError

__all__ = ["AgentSession", "SessionHub", "assistant_reply", "normal_messages"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Tool:
  """A tool as the chat template renders it (``envs.chat.tool_schemas``)."""

  name: str
  description: str
  parameters: dict


def assistant_reply(text: str, parser: str | None):
  """(content or None, [(name, arguments)]) of a finished assistant turn: its tool calls in
  the model's format when ``parser`` is set (the server's answer and the session's record
  are both this)."""
  if parser is None:
    return text, []
  turn = tool_calls.get_parser(parser)(text)
  if not turn.calls:
    return text, []
  return (turn.content.strip() or None), [(c.name, dict(c.arguments)) for c in turn.calls]


def normal_messages(messages) -> list[tuple]:
  """OpenAI chat messages (pydantic ``ChatMessage``) in a comparable form: (role, text,
  tool calls as (name, arguments JSON with sorted keys))."""
  out = []
  for m in messages:
    calls = ()
    if m.tool_calls:
      calls = tuple((c.function.name, _canonical(c.function.arguments)) for c in m.tool_calls)
    out.append((m.role, m.text(), calls))
  return out


def _canonical(arguments: str) -> str:
  try:
    return json.dumps(json.loads(arguments or "{}"), sort_keys=True)
  except json.JSONDecodeError:
    return arguments


def _as_message(m) -> Message:
  """A client's message as an environment message (the engine renders it with the chat
  template; a tool result keeps its tool's name when the client gives it)."""
  role = "system" if m.role == "developer" else m.role
  return Message(role, m.text(), m.name if m.role == "tool" else None)


class SessionHub:
  """The sessions of one run and the server they are reached through.

  Args:
    agent: the agent function ``fn(base_url, api_key, example) -> reward``.
    start_server: ``hub -> base URL`` (``http://host:port``), called once, on first use.
    parser: the tool-call format answers are parsed in (None: plain text).
    first_request_timeout: seconds an agent may take to send its first request.
  """

  def __init__(self, agent: Callable, start_server: Callable[["SessionHub"], str], *,
               parser: str | None, first_request_timeout: float = 120.0):
    self.agent, self.parser = agent, parser
    self.api_key = secrets.token_hex(16)
    self.first_request_timeout = float(first_request_timeout)
    self._start_server, self._url = start_server, None
    self._sessions: dict[str, AgentSession] = {}
    self._lock = threading.Lock()
    self.stats: collections.Counter = collections.Counter()
    self._failures = 0

  def url(self) -> str:
    with self._lock:
      if self._url is None:
        self._url = self._start_server(self)
      return self._url

  def make_env(self, example=None) -> "AgentSession":
    del example  # one session type for every example
    return AgentSession(self)

  def get(self, sid: str) -> "AgentSession":
    s = self._sessions.get(sid)
    if s is None:
      raise ApiError(404, f"no open session {sid!r} (it ended, or never existed)",
                     code="session_not_found")
    return s

  def open(self, session: "AgentSession") -> str:
    sid = secrets.token_hex(8)
    with self._lock:
      self._sessions[sid] = session
      self.stats["sessions"] += 1
    return sid

  def close(self, sid: str | None) -> None:
    with self._lock:
      self._sessions.pop(sid, None)

  def failed(self, why: str) -> None:
    """Count an episode whose agent function failed; the first few are logged."""
    with self._lock:
      self.stats["agent_errors"] += 1
      self._failures += 1
      if self._failures <= 5:
        log.warning("env.agent: an episode ended because the agent function %s%s", why,
                    " (later failures are only counted)" if self._failures == 5 else "")

  def take_stats(self) -> dict[str, float]:
    """Counters since the last call: ``agent_errors``, ``session_rewrites``, ``sessions``."""
    with self._lock:
      out = {k: float(self.stats.get(k, 0)) for k in ("agent_errors", "session_rewrites",
                                                     "sessions")}
      self.stats.clear()
    return out


class AgentSession:
  """One episode of the agent function (module docstring); an ``Environment``."""

  concurrent_reset = True  # reset waits for the agent's first request: the engine threads it

  def __init__(self, hub: SessionHub):
    self.hub = hub
    self.tools: tuple = ()
    self.sid: str | None = None
    self._inbox: queue.Queue = queue.Queue()
    self._pending: cf.Future | None = None
    self._seen: list[tuple] = []
    self._ended = True  # no episode open: a step has no agent to wait for

  # ---------------------------------------------------------------- the HTTP side
  def deliver(self, messages, tools) -> cf.Future:
    """A request of this session: (client messages, tool dicts); the future resolves to the
    assistant's text when the engine has sampled the turn (or to an ApiError)."""
    fut: cf.Future = cf.Future()
    self._inbox.put(("request", (messages, tools, fut)))
    return fut

  # ---------------------------------------------------------------- the engine side
  def reset(self, example, seed: int):
    del seed  # the agent sees the example; sampling is seeded by the engine
    self._end()
    self._inbox, self._ended = queue.Queue(), False
    self.sid = self.hub.open(self)
    base_url, inbox = f"{self.hub.url()}/s/{self.sid}/v1", self._inbox
    threading.Thread(target=self._run_agent, args=(base_url, example, inbox), daemon=True,
                     name=f"agent-{self.sid}").start()
    kind, value = self._next(self.hub.first_request_timeout)
    if kind != "request":
      self._end()
      what = "returned" if kind == "return" else value
      raise ConfigError(f"env.agent: the agent function {what} before its first request "
                        "(an episode's opening prompt is its first request)")
    messages, tools, fut = value
    self.tools = tuple(_Tool(t["function"]["name"], t["function"].get("description") or "",
                             t["function"].get("parameters") or {}) for t in tools)
    self._pending, self._seen = fut, normal_messages(messages)
    return [_as_message(m) for m in messages]

  def step(self, action: str) -> StepResult:
    content, calls = assistant_reply(action, self.hub.parser)
    self._seen.append(("assistant", content or "",
                       tuple((n, json.dumps(a, sort_keys=True)) for n, a in calls)))
    info = {"tool_calls": len(calls)}
    if self._ended:  # its agent is gone: nothing will answer (an episode kept on by mistake)
      return StepResult((), 0.0, True, info)
    if self._pending is not None and not self._pending.done():
      self._pending.set_result(action)
    self._pending = None
    kind, value = self._next(None)
    if kind == "return":
      self._end()
      return StepResult((), self._reward(value), True, info)
    if kind == "error":
      self._end()
      self.hub.failed(value)
      return StepResult((), 0.0, True, info)
    messages, _, fut = value
    got = normal_messages(messages)
    if got[:len(self._seen)] != self._seen or len(got) == len(self._seen):
      fut.set_exception(ApiError(
          400, "this request does not extend the session's conversation (the earlier messages "
          "and the assistant's answers must be sent back unchanged, with new messages after "
          "them); the episode has ended", param="messages", code="session_rewritten"))
      self._end()
      self.hub.stats["session_rewrites"] += 1
      return StepResult((), 0.0, True, info)
    new = messages[len(self._seen):]
    self._pending, self._seen = fut, got
    return StepResult(tuple(_as_message(m) for m in new), 0.0, False, info)

  # ---------------------------------------------------------------- internals
  def _reward(self, value) -> float:
    """The agent function's return as the episode's reward; anything but a finite number
    is a failed episode (reward 0, counted in ``agent_errors``)."""
    try:  # a string is not a number, though float() reads "1.0" (as envs.base.step_problem)
      reward = math.nan if isinstance(value, (str, bytes)) else float(value)
    except (TypeError, ValueError):
      reward = math.nan
    if not math.isfinite(reward):
      self.hub.failed(f"returned {value!r}, not a finite number")
      return 0.0
    return reward

  def _run_agent(self, base_url: str, example, inbox: queue.Queue) -> None:
    try:
      inbox.put(("return", self.hub.agent(base_url, self.hub.api_key, example)))
    except BaseException as e:  # pylint: disable=broad-except  # the episode fails, not the run
      inbox.put(("error", f"raised {type(e).__name__}: {' '.join(str(e).split())}"))

  def _next(self, timeout: float | None):
    try:
      return self._inbox.get(timeout=timeout)
    except queue.Empty:
      return ("error", f"sent no request within {timeout:g} s")

  def _end(self) -> None:
    """Close the session: later requests get 404; a pending one gets an error."""
    if self._pending is not None and not self._pending.done():
      self._pending.set_exception(ApiError(409, "the episode has ended", code="session_ended"))
    self._pending, self._ended = None, True
    self.hub.close(self.sid)


def free_port() -> int:
  """A free TCP port on 127.0.0.1."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_uvicorn(app, port: int, timeout: float = 60.0) -> str:
  """Serve ``app`` on 127.0.0.1:``port`` in a daemon thread; returns its base URL."""
  import uvicorn  # pylint: disable=import-outside-toplevel
  # keep idle connections open well past a training step: an agent's pooled connection that
  # the server closed while the client reused it fails the request (no retry is safe)
  server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                         timeout_keep_alive=600))
  thread = threading.Thread(target=server.run, daemon=True, name="rl_jax-sessions")
  thread.start()
  deadline = time.monotonic() + timeout
  while not server.started:
    if not thread.is_alive() or time.monotonic() > deadline:
      raise RuntimeError(f"the session server did not start on 127.0.0.1:{port}")
    time.sleep(0.02)
  return f"http://127.0.0.1:{port}"
