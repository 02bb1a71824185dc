"""Chat templates and append-only tokenization for multi-turn rollouts.

A multi-turn episode is one token sequence: the prompt, the model's first assistant turn (ids
as sampled, ending with the end-of-turn token), the environment's messages, the next
generation prompt, the next sampled turn, and so on. The trainer must score exactly the ids
the model sampled, so this module never re-renders or re-tokenizes a sampled turn. Instead:

* ``ChatFormat.prompt_ids(messages, tools)`` tokenizes the opening prompt, with the
  generation prompt, once.
* ``ChatFormat.delta_ids(history, new)`` renders text twice -- the history (which ends with
  the sampled assistant turn, as decoded text) and history + new messages with the
  generation prompt -- and tokenizes only the difference. The difference starts right after
  the end-of-turn string that closes the last assistant turn (the model sampled that token),
  so whatever the template writes after it (Qwen's "\\n" after "<|im_end|>") belongs to the
  delta.

Tokenizing the delta on its own gives the same ids as tokenizing it in context because it
starts right after a special token, where tokenizers split anyway. A turn cut off before its
end-of-turn token (length limit) must be closed by the caller (append
``end_of_turn_ids[0]``) before ``delta_ids``, or the episode ended.

Append-only templates. The difference is well defined only when rendering history + new
extends the rendering of history (up to the end of the last assistant turn). Some templates
are not append-only: Qwen3's drops the ``<think>`` block of assistant turns that precede the
latest user message, so a new user message rewrites earlier turns. ``ChatFormat`` probes the
template once (``check_append_only``) and logs one warning line naming the template. For such
templates, and for any call whose render is not an extension, ``delta_ids`` falls back to
rendering the new messages after a fixed dummy context (a user turn and an assistant turn) and
taking the text after the dummy assistant's end-of-turn: the new messages are tokenized the
way the template writes them after an assistant turn; the sampled history is kept as sampled
(what the model saw is what is trained on, even if a fresh render of the conversation would
differ).

Templates render with ``jinja2`` in an immutable sandbox configured as Hugging Face
transformers configures it (``trim_blocks``, ``lstrip_blocks``, loop controls,
``raise_exception``, a ``tojson`` that does not escape HTML, ``strftime_now``), with the
tokenizer's special-token strings (``bos_token``, ``eos_token``, ...) and ``tools`` as JSON
schemas ``{"type": "function", "function": {name, description, parameters}}``.

``ChatFormat.builtin(tokenizer)`` is a compact template for the character tokenizer of the
tiny built-in agent tasks: "S:..\\n" (system), "U:..\\n" (user), "T:..\\n" (tool), and
"A:" + content + eos (assistant); the generation prompt is "A:". Its end of turn is eos.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox

from rl_jax.data.tokenizers import CHARS, CharTokenizer

__all__ = ["BUILTIN_TEMPLATE", "ChatFormat", "check_append_only", "compile_template",
           "tool_schemas"]

log = logging.getLogger(__name__)

BUILTIN_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}A:{{ m.content }}{{ eos_token }}"
    "{% elif m.role == 'tool' %}T:{{ m.content }}\n"
    "{% elif m.role == 'system' %}S:{{ m.content }}\n"
    "{% else %}U:{{ m.content }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}")

# Strings that commonly end an assistant turn; the one a template writes is found by probing.
_END_OF_TURN_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>",
                           "<|end|>", "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
_SENTINEL = "zq7SENTINELq7z"
_DUMMY = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL})
# Probes for check_append_only: (history, new messages).
_PROBES = (
    ([{"role": "user", "content": "a"},
      {"role": "assistant", "content": "<think>\nr\n</think>\n\nb"}],
     [{"role": "user", "content": "c"}]),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
     [{"role": "tool", "content": "t", "name": "f"}]),
)


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
  """Compile a chat template in a sandbox configured like Hugging Face transformers'."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env.from_string(source)


def tool_schemas(tools: Iterable[Any]) -> list[dict[str, Any]] | None:
  """JSON schemas of tools (``rl_jax.envs.base.Tool`` objects or schema dicts); None if none."""
  out = []
  for t in tools:
    if isinstance(t, Mapping):
      out.append(dict(t))
    else:
      out.append({"type": "function", "function": {
          "name": t.name, "description": t.description, "parameters": dict(t.parameters)}})
  return out or None


def _as_dicts(messages: Iterable[Any]) -> list[dict[str, Any]]:
  return [dict(m) if isinstance(m, Mapping) else m.as_dict() for m in messages]


def _special_strings(cfg: Mapping[str, Any]) -> dict[str, str]:
  """``{"bos_token": "<s>", ...}`` from a tokenizer_config (values are strings or dicts)."""
  out = {}
  for key, value in cfg.items():
    if key.endswith("_token"):
      if isinstance(value, Mapping):
        value = value.get("content")
      if isinstance(value, str):
        out[key] = value
  return out


def _read_template(dirpath: str, cfg: Mapping[str, Any], with_tools: bool) -> str:
  path = os.path.join(dirpath, "chat_template.jinja")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return f.read()
  tpl = cfg.get("chat_template")
  if isinstance(tpl, list):  # named templates: [{"name": ..., "template": ...}]
    named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, Mapping)}
    tpl = named.get("tool_use") if with_tools and "tool_use" in named else named.get("default")
  if not isinstance(tpl, str):
    raise ValueError(f"no chat template in {dirpath!r} (tokenizer_config.json 'chat_template' "
                     "or chat_template.jinja)")
  return tpl


class ChatFormat:
  """A chat template bound to a tokenizer (see the module docstring).

  Attributes:
    name: the template's name in messages (the checkpoint directory, or "builtin").
    end_of_turn: the string that ends an assistant turn.
    end_of_turn_ids: token ids that end an assistant turn (the engine stops a turn there).
    append_only: whether the template passed ``check_append_only``'s probes.
  """

  def __init__(self, template: str, tokenizer: Any, special_tokens: Mapping[str, str],
               name: str = "template", end_of_turn: str | None = None,
               special_ids: Mapping[str, int] | None = None,
               template_vars: Mapping[str, Any] | None = None):
    """Bind a template to a tokenizer.

    Args:
      template: jinja2 chat template source.
      tokenizer: an object with ``encode(text) -> list[int]``, ``eos_id`` (see
        ``rl_jax.data.tokenizers``).
      special_tokens: strings passed to the template (``bos_token``, ``eos_token``, ...).
      name: the template's name in messages.
      end_of_turn: the string that ends an assistant turn; probed from the template if None.
      special_ids: strings the tokenizer cannot encode as text, mapped to their ids (the
        char tokenizer's "<eos>"); text is split on them before encoding.
      template_vars: extra variables every render passes to the template (Qwen3's
        ``enable_thinking``).
    """
    self.name = name
    self.tokenizer = tokenizer
    self.source = template
    self._template = compile_template(template)
    self._special_tokens = dict(special_tokens)
    self._vars = {**self._special_tokens, **dict(template_vars or {})}
    self._special_ids = dict(special_ids or {})
    self.end_of_turn = end_of_turn or self._probe_end_of_turn()
    eot_ids = self.encode(self.end_of_turn)
    if len(eot_ids) != 1:
      raise ValueError(f"end of turn {self.end_of_turn!r} of template {name!r} is not one token "
                       f"({eot_ids})")
    self.end_of_turn_ids = tuple(dict.fromkeys([eot_ids[0], int(tokenizer.eos_id)]))
    self.append_only = check_append_only(self)
    if not self.append_only:
      log.warning("chat template %r is not append-only (it re-renders earlier turns); "
                  "delta_ids renders new messages after a fixed dummy context", name)

  @classmethod
  def from_pretrained(cls, dirpath: str, tokenizer: Any, with_tools: bool = False,
                      end_of_turn: str | None = None,
                      template_vars: Mapping[str, Any] | None = None) -> "ChatFormat":
    """The chat template of a checkpoint directory.

    Reads ``chat_template.jinja`` if present, else ``chat_template`` from
    ``tokenizer_config.json`` (with named templates, "tool_use" if ``with_tools`` else
    "default"); special-token strings come from ``tokenizer_config.json``;
    ``template_vars`` as in the constructor.

    Raises:
      ValueError: no template, or one that does not compile or render (one line).
    """
    cfg_path = os.path.join(dirpath, "tokenizer_config.json")
    cfg = {}
    if os.path.isfile(cfg_path):
      with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    template = _read_template(dirpath, cfg, with_tools)
    name = os.path.basename(os.path.normpath(dirpath))
    try:  # the constructor compiles the template and renders probe conversations with it
      return cls(template, tokenizer, _special_strings(cfg), name=name,
                 end_of_turn=end_of_turn, template_vars=template_vars)
    except jinja2.TemplateError as e:
      where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
      raise ValueError(f"the chat template of {dirpath!r} does not render{where}: "
                       f"{type(e).__name__}: {' '.join(str(e).split())}") from None

  @classmethod
  def builtin(cls, tokenizer: Any | None = None) -> "ChatFormat":
    """The compact built-in template (module docstring) for the character tokenizer."""
    tokenizer = tokenizer or CharTokenizer()
    eos = "<eos>"
    return cls(BUILTIN_TEMPLATE, tokenizer, {"eos_token": eos}, name="builtin",
               end_of_turn=eos, special_ids={eos: int(tokenizer.eos_id)})

  # -- rendering and tokenization --

  def render(self, messages: Iterable[Any], tools: Iterable[Any] = (),
             add_generation_prompt: bool = False) -> str:
    """The template's text for messages (``Message`` objects or dicts)."""
    return self._template.render(
        messages=_as_dicts(messages), tools=tool_schemas(tools), documents=None,
        add_generation_prompt=add_generation_prompt, **self._vars)

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text``; special strings in ``special_ids`` map to their ids.

    For the character tokenizer, characters outside its vocabulary become "?" (environment
    text may hold any character; sampled text never reaches this function).
    """
    if not self._special_ids:
      return list(self.tokenizer.encode(text))
    return _encode_split(text, self._special_ids, self._encode_plain)

  def _encode_plain(self, text: str) -> list[int]:
    if isinstance(self.tokenizer, CharTokenizer):
      text = "".join(c if c in CHARS else "?" for c in text)
    return list(self.tokenizer.encode(text))

  def prompt_ids(self, messages: Sequence[Any], tools: Iterable[Any] = ()) -> list[int]:
    """Token ids of the opening prompt, generation prompt included."""
    return self.encode(self.render(messages, tools, add_generation_prompt=True))

  def delta_text(self, history_messages: Sequence[Any], new_messages: Sequence[Any],
                 tools: Iterable[Any] = ()) -> str:
    """The text ``delta_ids`` tokenizes (see the module docstring).

    Args:
      history_messages: the conversation so far; its last message is the assistant turn the
        model sampled (decoded text).
      new_messages: the environment's messages to append.
      tools: the tools the prompt advertised.
    """
    history, new = _as_dicts(history_messages), _as_dicts(new_messages)
    if not history or history[-1].get("role") != "assistant":
      raise ValueError("delta_ids: the history must end with the sampled assistant turn")
    tools = tuple(tools)
    if self.append_only:
      head = self.render(history, tools)
      cut = head.rfind(self.end_of_turn)
      full = self.render(history + new, tools, add_generation_prompt=True)
      if cut >= 0:
        cut += len(self.end_of_turn)
        if full[:cut] == head[:cut]:
          return full[cut:]
      log.debug("template %r: render not an extension here; dummy-context fallback", self.name)
    return self._dummy_delta(new, tools)

  def _dummy_delta(self, new: list[dict[str, Any]], tools: Sequence[Any]) -> str:
    full = self.render(list(_DUMMY) + new, tools, add_generation_prompt=True)
    at = full.rfind(_SENTINEL)
    cut = full.find(self.end_of_turn, at) if at >= 0 else -1
    if cut < 0:
      raise ValueError(f"template {self.name!r}: cannot find the end of the dummy assistant "
                       "turn")
    return full[cut + len(self.end_of_turn):]

  def delta_ids(self, history_messages: Sequence[Any], new_messages: Sequence[Any],
                tools: Iterable[Any] = ()) -> list[int]:
    """Token ids to append after the sampled assistant turn (which ended with its
    end-of-turn token): the new messages, then the next generation prompt."""
    return self.encode(self.delta_text(history_messages, new_messages, tools))

  def _probe_end_of_turn(self) -> str:
    text = self.render(list(_DUMMY))
    after = text[text.rfind(_SENTINEL) + len(_SENTINEL):]
    eos = self._special_tokens.get("eos_token")
    for cand in ((eos,) if eos else ()) + _END_OF_TURN_CANDIDATES:
      if after.startswith(cand) and len(self.encode(cand)) == 1:
        return cand
    raise ValueError(f"cannot tell the end-of-turn token of template {self.name!r} (text after "
                     f"an assistant turn: {after[:30]!r}); pass end_of_turn=")


def _encode_split(text: str, special_ids: Mapping[str, int], encode) -> list[int]:
  """Encode ``text`` with ``encode``, mapping every occurrence of a special string to its id."""
  ids: list[int] = []
  pos = 0
  while pos < len(text):
    hits = [(text.find(s, pos), s) for s in special_ids]
    hits = [(i, s) for i, s in hits if i >= 0]
    if not hits:
      ids += encode(text[pos:])
      break
    i, s = min(hits, key=lambda h: (h[0], -len(h[1])))
    if i > pos:
      ids += encode(text[pos:i])
    ids.append(special_ids[s])
    pos = i + len(s)
  return ids


def check_append_only(fmt: ChatFormat, history_messages: Sequence[Any] | None = None,
                      new_messages: Sequence[Any] | None = None) -> bool:
  """Whether rendering history + new extends the rendering of history up to the end of the
  last assistant turn.

  With no messages given, checks built-in probes (a ``<think>`` turn followed by a user
  message, and a tool message); a probe the template rejects (``raise_exception``) is
  skipped.
  """
  if history_messages is None:
    probes = _PROBES
  else:
    probes = ((_as_dicts(history_messages), _as_dicts(new_messages or ())),)
  for history, new in probes:
    try:
      head = fmt.render(history)
      full = fmt.render(list(history) + list(new), add_generation_prompt=True)
    except jinja2.exceptions.TemplateError:
      if history_messages is not None:
        raise
      continue
    cut = head.rfind(fmt.end_of_turn)
    if cut < 0:
      return False
    cut += len(fmt.end_of_turn)
    if full[:cut] != head[:cut]:
      return False
  return True
