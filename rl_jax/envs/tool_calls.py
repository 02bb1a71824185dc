"""Tool-call parsers: assistant text -> tool calls plus parse errors, as values (never raise).

Formats:

* ``hermes`` (Qwen 2.5/3, Hermes): any number of
  ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` blocks in a turn; the text
  outside them is the turn's content. An unterminated block at the end of the turn is parsed
  too (the model may stop right after the JSON).
* ``llama3``: the whole message is one JSON object ``{"name": "f", "parameters": {...}}``
  (``"arguments"`` accepted), optionally after ``<|python_tag|>``; several calls may be
  separated by ";". A message that does not start with "{" (after the tag) is plain content.
* ``compact``: ``<c>12*34</c>`` -- a tag mapped to (tool name, argument name); short enough
  for the character-level models of the built-in tasks.

Errors carry a kind shared with ``rl_jax.envs.tools.ToolError``: "bad_json" (not JSON),
"bad_call" (no string "name", not an object, unterminated compact tag) and "bad_arguments"
(arguments not an object).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Mapping

__all__ = ["COMPACT_TAGS", "PARSERS", "ParseError", "ParsedTurn", "ToolCall", "get_parser",
           "parse_compact", "parse_hermes", "parse_llama3", "template_format"]


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One parsed call: the tool's name and its arguments object."""

  name: str
  arguments: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ParseError:
  """A call the model attempted but that could not be parsed.

  kind: "bad_json", "bad_call" or "bad_arguments". message: short explanation. text: the
  offending text. name: the tool's name when it could be read.
  """

  kind: str
  message: str
  text: str = ""
  name: str | None = None


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
  """An assistant turn split into tool calls, parse errors and the remaining content."""

  calls: tuple[ToolCall, ...] = ()
  errors: tuple[ParseError, ...] = ()
  content: str = ""

  @property
  def has_calls(self) -> bool:
    """Whether the turn attempted any tool call (parsed or not)."""
    return bool(self.calls or self.errors)


def _call_from_obj(obj: Any, text: str, arg_keys: tuple[str, ...]) -> ToolCall | ParseError:
  """Validate a decoded JSON call object."""
  if not isinstance(obj, dict):
    return ParseError("bad_call", "a tool call must be a JSON object", text)
  name = obj.get("name")
  if not isinstance(name, str) or not name:
    return ParseError("bad_call", "a tool call needs a string \"name\"", text)
  args: Any = {}
  for key in arg_keys:
    if key in obj:
      args = obj[key]
      break
  if isinstance(args, str):  # some models write the arguments as a JSON string
    try:
      args = json.loads(args)
    except json.JSONDecodeError:
      pass
  if args is None:
    args = {}
  if not isinstance(args, dict):
    return ParseError("bad_arguments", "tool arguments must be a JSON object", text, name)
  return ToolCall(name, args)


def _decode(text: str, arg_keys: tuple[str, ...]) -> ToolCall | ParseError:
  try:
    obj = json.loads(text)
  except (json.JSONDecodeError, RecursionError) as e:
    msg = str(e) if isinstance(e, json.JSONDecodeError) else "nested too deeply"
    return ParseError("bad_json", f"invalid JSON: {msg}", text)
  return _call_from_obj(obj, text, arg_keys)


def _split(results: list[ToolCall | ParseError], content: str) -> ParsedTurn:
  calls = tuple(r for r in results if isinstance(r, ToolCall))
  errors = tuple(r for r in results if isinstance(r, ParseError))
  return ParsedTurn(calls, errors, content.strip())


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
  """Parse Qwen/Hermes ``<tool_call>{json}</tool_call>`` blocks (see the module docstring)."""
  results = [_decode(m.group(1).strip(), ("arguments", "parameters"))
             for m in _HERMES.finditer(text)]
  return _split(results, _HERMES.sub("", text))


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3(text: str) -> ParsedTurn:
  """Parse a Llama 3 JSON tool call message (see the module docstring)."""
  body = text.strip()
  tagged = body.startswith(_PYTHON_TAG)
  if tagged:
    body = body[len(_PYTHON_TAG):].strip()
  if not body.startswith("{"):
    if tagged:
      return ParsedTurn(errors=(ParseError("bad_json", "expected a JSON call after the python "
                                           "tag", body),))
    return ParsedTurn(content=text.strip())
  try:
    return _split([_call_from_obj(json.loads(body), body, ("parameters", "arguments"))], "")
  except (json.JSONDecodeError, RecursionError):
    pass
  parts = [p.strip() for p in body.split(";") if p.strip()]
  if len(parts) > 1 and all(p.startswith("{") for p in parts):
    return _split([_decode(p, ("parameters", "arguments")) for p in parts], "")
  if not tagged and '"name"' not in body:
    return ParsedTurn(content=text.strip())  # braces in a plain answer
  return _split([_decode(body, ("parameters", "arguments"))], "")


# tag -> (tool name, argument name)
COMPACT_TAGS: Mapping[str, tuple[str, str]] = {"c": ("calc", "expr")}


def parse_compact(text: str, tags: Mapping[str, tuple[str, str]] = COMPACT_TAGS) -> ParsedTurn:
  """Parse compact calls ``<t>argument</t>`` for each tag ``t`` in ``tags``."""
  alt = "|".join(re.escape(t) for t in sorted(tags, key=len, reverse=True))
  pattern = re.compile(rf"<({alt})>(.*?)(</\1>|\Z)", re.DOTALL)
  results: list[ToolCall | ParseError] = []
  for m in pattern.finditer(text):
    name, arg = tags[m.group(1)]
    if not m.group(3):
      results.append(ParseError("bad_call", f"unterminated <{m.group(1)}>", m.group(0), name))
    else:
      results.append(ToolCall(name, {arg: m.group(2)}))
  return _split(results, pattern.sub("", text))


PARSERS: Mapping[str, Callable[[str], ParsedTurn]] = {
    "hermes": parse_hermes, "qwen": parse_hermes, "llama3": parse_llama3,
    "compact": parse_compact}


def get_parser(parser: str | Callable[[str], ParsedTurn]) -> Callable[[str], ParsedTurn]:
  """A parser by name ("hermes"/"qwen", "llama3", "compact") or a callable passed through."""
  if callable(parser):
    return parser
  if parser not in PARSERS:
    raise ValueError(f"unknown tool-call parser {parser!r}; choose from {sorted(PARSERS)}")
  return PARSERS[parser]


# (format, markers): a chat template that writes one of the markers asks for that format
_TEMPLATE_MARKERS = (("hermes", ("<tool_call>",)), ("llama3", ("<|python_tag|>", "ipython")))


def template_format(template: str) -> str | None:
  """The tool-call format a chat template's source teaches the model: "hermes" when it writes
  ``<tool_call>`` (Qwen 2.5/3, Hermes), "llama3" when it writes ``<|python_tag|>`` or the
  ``ipython`` role; None when it names neither."""
  for name, markers in _TEMPLATE_MARKERS:
    if any(m in template for m in markers):
      return name
  return None
