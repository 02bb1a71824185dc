"""Chat templates: parity with transformers' apply_chat_template, append-only deltas,
non-append-only detection and fallback, the built-in char template."""

import logging

import pytest

from rl_jax.data.tokenizers import CharTokenizer, HFTokenizer
from rl_jax.envs import Message
from rl_jax.envs.chat import ChatFormat, check_append_only
from tests import envs_fixtures

TOOL = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                   "required": ["expr"]}}}

CONVERSATIONS = [
    [Message("user", "What is 12*34?")],
    [Message("system", "Be brief."), Message("user", "hi")],
    [Message("user", "What is 12*34?"),
     Message("assistant", '<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call>'),
     Message("tool", "408", name="calc"), Message("tool", "ok", name="calc"),
     Message("assistant", "408"), Message("user", "thanks <b>&</b> ünïcode")],
]


def _fmt(tmp_path, style, **kw):
  path = envs_fixtures.write_checkpoint(tmp_path / style, style, **kw)
  return ChatFormat.from_pretrained(str(path), HFTokenizer(str(path))), path


@pytest.fixture(scope="module")
def transformers_tokenizers(tmp_path_factory):
  import transformers  # pylint: disable=import-outside-toplevel
  out = {}
  for style in ("qwen", "llama3"):
    path = envs_fixtures.write_checkpoint(tmp_path_factory.mktemp(style), style)
    out[style] = (path, transformers.PreTrainedTokenizerFast.from_pretrained(str(path)))
  return out


@pytest.mark.parametrize("style", ["qwen", "llama3"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("tools", [False, True])
@pytest.mark.parametrize("gen", [False, True])
def test_render_matches_transformers(transformers_tokenizers, style, conv, tools, gen):
  path, hf = transformers_tokenizers[style]
  fmt = ChatFormat.from_pretrained(str(path), HFTokenizer(str(path)))
  messages = CONVERSATIONS[conv]
  tool_list = [TOOL] if tools else None
  expected = hf.apply_chat_template([m.as_dict() for m in messages], tools=tool_list,
                                    add_generation_prompt=gen, tokenize=False)
  assert fmt.render(messages, tool_list or (), add_generation_prompt=gen) == expected


def test_template_file_takes_precedence(tmp_path):
  fmt, _ = _fmt(tmp_path, "qwen", template_file=True)
  assert fmt.render([Message("user", "x")]).startswith("<|im_start|>system")


@pytest.mark.parametrize("source,words", [
    ("{% for m in messages %}{{ m['content'] }}}{% endfor %", "TemplateSyntaxError"),
    ("{{ messages[0]['content'] | nosuchfilter }}", "TemplateAssertionError"),
    ("{{ raise_exception('this template takes no system turn') }}",
     "TemplateError: this template takes no system turn"),
])
def test_a_chat_template_that_does_not_render_is_one_line(tmp_path, source, words):
  """A template that does not compile or render: one ValueError line naming its directory
  (the trainer and the server print it as their one error line), not jinja2's traceback."""
  path = envs_fixtures.write_checkpoint(tmp_path / "qwen", "qwen")
  (path / "chat_template.jinja").write_text(source)
  with pytest.raises(ValueError) as e:
    ChatFormat.from_pretrained(str(path), HFTokenizer(str(path)))
  assert str(e.value).startswith(f"the chat template of {str(path)!r} does not render")
  assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("style,eot", [("qwen", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_end_of_turn(tmp_path, style, eot):
  fmt, path = _fmt(tmp_path, style)
  tok = HFTokenizer(str(path))
  assert fmt.end_of_turn == eot
  assert fmt.end_of_turn_ids == (tok.encode(eot)[0],)
  assert fmt.append_only


@pytest.mark.parametrize("style", ["qwen", "llama3"])
def test_append_only_delta_rebuilds_the_full_render(tmp_path, style):
  fmt, _ = _fmt(tmp_path, style)
  prompt = [Message("user", "What is 12*34?")]
  turns = [('<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call>',
            [Message("tool", "408", name="calc"), Message("tool", "done", name="calc")]),
           ("Answer: 408", [Message("user", "and 2*3?")]),
           ("6", [])]
  ids = fmt.prompt_ids(prompt, [TOOL])
  history = list(prompt)
  for content, new in turns:
    ids += fmt.encode(content) + [fmt.end_of_turn_ids[0]]  # what the model sampled
    history.append(Message("assistant", content))
    if new:
      ids += fmt.delta_ids(history, new, [TOOL])
      history += new
  full = fmt.render(history, [TOOL])
  assert fmt.encode(full)[:len(ids)] == ids
  # What is left after the last assistant's end of turn is only template trailer (qwen "\n").
  assert fmt.tokenizer.decode(fmt.encode(full)[len(ids):]) in ("", "\n")


def test_qwen_delta_starts_after_end_of_turn(tmp_path):
  fmt, _ = _fmt(tmp_path, "qwen")
  history = [Message("user", "q"), Message("assistant", "a")]
  text = fmt.delta_text(history, [Message("tool", "r", name="f")])
  assert text == "\n<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n" \
                 "<|im_start|>assistant\n"


def test_delta_requires_assistant_last(tmp_path):
  fmt, _ = _fmt(tmp_path, "qwen")
  with pytest.raises(ValueError, match="assistant"):
    fmt.delta_ids([Message("user", "q")], [Message("user", "r")])


def test_non_append_only_template_detected_with_one_warning(tmp_path, caplog):
  with caplog.at_level(logging.WARNING, logger="rl_jax.envs.chat"):
    fmt, _ = _fmt(tmp_path, "qwen3")
  assert not fmt.append_only
  warnings = [r for r in caplog.records if "append-only" in r.getMessage()]
  assert len(warnings) == 1 and "qwen3" in warnings[0].getMessage()
  history = [Message("user", "q"), Message("assistant", "<think>\nhm\n</think>\n\nA")]
  new = [Message("user", "next")]
  assert not check_append_only(fmt, history, new)
  # Fallback: the new messages as the template writes them after an assistant turn.
  assert fmt.delta_text(history, new) == \
      "\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"
  ids = fmt.delta_ids(history, new)
  assert ids == fmt.encode("\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n")


def test_append_only_template_passes_check(tmp_path):
  fmt, _ = _fmt(tmp_path, "qwen")
  history = [Message("user", "q"), Message("assistant", "<think>\nhm\n</think>\n\nA")]
  assert check_append_only(fmt, history, [Message("user", "next")])


def test_builtin_char_template():
  tok = CharTokenizer()
  fmt = ChatFormat.builtin(tok)
  assert fmt.end_of_turn_ids == (tok.eos_id,)
  assert fmt.append_only
  prompt = [Message("user", "12*34")]
  ids = fmt.prompt_ids(prompt)
  assert ids == tok.encode("U:12*34\nA:")
  sampled = tok.encode("<c>12*34</c>") + [tok.eos_id]
  history = prompt + [Message("assistant", "<c>12*34</c>")]
  delta = fmt.delta_ids(history, [Message("tool", "408", name="calc")])
  assert delta == tok.encode("T:408\nA:")
  full = ids + sampled + delta
  assert full == fmt.encode(fmt.render(history + [Message("tool", "408")],
                                       add_generation_prompt=True))
  # Characters outside the char vocabulary become "?" in environment text.
  assert fmt.delta_ids(history, [Message("user", "é\t")]) == tok.encode("U:??\nA:")
