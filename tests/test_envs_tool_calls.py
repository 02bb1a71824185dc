"""Tool-call parsers: well-formed and malformed calls, errors as values."""

import pytest

from rl_jax.envs.tool_calls import (ParsedTurn, ToolCall, get_parser, parse_compact,
                                    parse_hermes, parse_llama3)


def test_hermes_several_calls_and_content():
  text = ('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "1+2"}}\n'
          '</tool_call>\n<tool_call>{"name": "python", "arguments": {"code": "print(3)"}}'
          '</tool_call>')
  out = parse_hermes(text)
  assert out.calls == (ToolCall("calc", {"expr": "1+2"}), ToolCall("python", {"code": "print(3)"}))
  assert out.errors == () and out.content == "Let me compute." and out.has_calls


def test_hermes_no_call_is_content():
  out = parse_hermes("The answer is 408.")
  assert out == ParsedTurn(content="The answer is 408.") and not out.has_calls


@pytest.mark.parametrize("body,kind", [
    ('{"name": "calc", "arguments": {"expr": "1+2"}', "bad_json"),
    ("not json at all", "bad_json"),
    ('{"arguments": {"expr": "1"}}', "bad_call"),
    ('{"name": 3, "arguments": {}}', "bad_call"),
    ('["calc"]', "bad_call"),
    ('{"name": "calc", "arguments": [1, 2]}', "bad_arguments"),
    ('{"name": "calc", "arguments": "oops"}', "bad_arguments"),
    ("[" * 100000 + "]" * 100000, "bad_json"),
])
def test_hermes_malformed(body, kind):
  out = parse_hermes(f"<tool_call>{body}</tool_call>")
  assert out.calls == () and len(out.errors) == 1 and out.errors[0].kind == kind
  assert out.has_calls


def test_hermes_mixed_good_and_bad_and_unterminated():
  out = parse_hermes('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
                     '<tool_call>{bad}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}')
  assert out.calls == (ToolCall("a", {}), ToolCall("b", {"x": 1}))
  assert [e.kind for e in out.errors] == ["bad_json"]


def test_hermes_arguments_as_json_string():
  out = parse_hermes('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>')
  assert out.calls == (ToolCall("a", {"x": 1}),)


def test_llama3_calls():
  assert parse_llama3('{"name": "calc", "parameters": {"expr": "2*3"}}').calls == (
      ToolCall("calc", {"expr": "2*3"}),)
  assert parse_llama3('<|python_tag|>{"name": "calc", "arguments": {"expr": "2"}}').calls == (
      ToolCall("calc", {"expr": "2"}),)
  two = parse_llama3('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}')
  assert two.calls == (ToolCall("a", {}), ToolCall("b", {"y": 2}))


def test_llama3_plain_content_and_errors():
  assert parse_llama3("The answer is {x}.") == ParsedTurn(content="The answer is {x}.")
  assert parse_llama3("{not a call}").content == "{not a call}"
  bad = parse_llama3('{"name": "calc", "parameters": {"expr": ')
  assert [e.kind for e in bad.errors] == ["bad_json"]
  assert [e.kind for e in parse_llama3("<|python_tag|>calc(1)").errors] == ["bad_json"]
  assert [e.kind for e in parse_llama3('{"name": "a", "parameters": 5}').errors] == [
      "bad_arguments"]


def test_compact():
  out = parse_compact("<c>12*34</c>")
  assert out.calls == (ToolCall("calc", {"expr": "12*34"}),) and out.content == ""
  assert parse_compact("408").calls == ()
  bad = parse_compact("<c>12*3")
  assert [e.kind for e in bad.errors] == ["bad_call"] and bad.has_calls
  custom = parse_compact("<p>x</p>", tags={"p": ("python", "code")})
  assert custom.calls == (ToolCall("python", {"code": "x"}),)


def test_get_parser():
  assert get_parser("qwen") is parse_hermes
  assert get_parser(parse_compact) is parse_compact
  with pytest.raises(ValueError, match="unknown tool-call parser"):
    get_parser("nope")
