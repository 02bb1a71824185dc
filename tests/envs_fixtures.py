"""Fixtures for the environment tests: a tiny byte-level HF tokenizer written to a directory
with a chat template (Qwen-style, Llama-3-style, a Qwen3-style template that drops earlier
reasoning, or a Qwen3-style one with tools and ``enable_thinking``), built locally with the
``tokenizers`` library."""

from __future__ import annotations

import json
import pathlib

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]

QWEN_STYLE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{% else %}{{- 'You are helpful.' }}{% endif %}
{{- '\n\n# Tools\n<tools>' }}
{%- for t in tools %}{{- '\n' + (t | tojson) }}{% endfor %}
{{- '\n</tools>\nReply with <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n' }}
{%- elif messages[0].role != 'system' %}
{{- '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
  {%- if m.role == 'system' %}
    {%- if not tools %}{{- '<|im_start|>system\n' + m.content + '<|im_end|>\n' }}{% endif %}
  {%- elif m.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{% endif %}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{% endif %}
  {%- else %}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{% endif %}
"""

LLAMA3_STYLE = r"""
{{- bos_token }}
{%- if tools %}
{{- '<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n' }}
{%- for t in tools %}{{- (t | tojson(indent=1)) + '\n' }}{% endfor %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for m in messages %}
  {%- if m.role == 'tool' %}{% set role = 'ipython' %}{% else %}{% set role = m.role %}{% endif %}
  {%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}
    {{- raise_exception('unknown role ' + m.role) }}
  {%- endif %}
  {{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}
"""

# Like Qwen3: assistant turns before the latest user message lose their <think> block.
QWEN3_STYLE = r"""
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
  {%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in m.content %}
    {{- '<|im_start|>assistant\n' + m.content.split('</think>')[-1].lstrip('\n') + '<|im_end|>\n' }}
  {%- elif m.role == 'tool' %}
    {{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
  {%- else %}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{% endif %}
"""

# Like Qwen3 with tools: a tool list in the system turn, hermes calls, tool results as user
# turns, earlier reasoning dropped, and an empty think block when enable_thinking is false.
QWEN3_TOOLS_STYLE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{% endif %}
{{- '# Tools\n<tools>' }}
{%- for t in tools %}{{- '\n' + (t | tojson) }}{% endfor %}
{{- '\n</tools>\nCall a tool as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
  {%- if m.role == 'assistant' %}
    {%- set body = m.content %}
    {%- if loop.index0 < ns.last_user and '</think>' in body %}{% set body = body.split('</think>')[-1].lstrip('\n') %}{% endif %}
    {{- '<|im_start|>assistant\n' + body + '<|im_end|>\n' }}
  {%- elif m.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{% endif %}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{% endif %}
  {%- elif m.role != 'system' %}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{% endif %}
{%- endif %}
"""

_TEMPLATES = {"qwen": (QWEN_STYLE, "<|im_end|>", None),
              "llama3": (LLAMA3_STYLE, "<|eot_id|>", "<|begin_of_text|>"),
              "qwen3": (QWEN3_STYLE, "<|im_end|>", None),
              "qwen3_tools": (QWEN3_TOOLS_STYLE, "<|im_end|>", None)}


def byte_level_tokenizer():
  """A ``tokenizers.Tokenizer``: byte-level BPE with no merges (one token per byte, so every
  string round-trips) plus the special tokens above."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders, models, pre_tokenizers

  alphabet = pre_tokenizers.ByteLevel.alphabet()
  vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(SPECIALS)
  return tok


def write_checkpoint(path: pathlib.Path, style: str, template_file: bool = False) -> pathlib.Path:
  """Write tokenizer.json and tokenizer_config.json (chat template inline, or in
  chat_template.jinja when ``template_file``) for a template style: qwen, llama3, qwen3,
  qwen3_tools."""
  template, eos, bos = _TEMPLATES[style]
  path.mkdir(parents=True, exist_ok=True)
  byte_level_tokenizer().save(str(path / "tokenizer.json"))
  cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos,
         "bos_token": bos, "model_max_length": 4096}
  if template_file:
    (path / "chat_template.jinja").write_text(template)
  else:
    cfg["chat_template"] = template
  (path / "tokenizer_config.json").write_text(json.dumps(cfg))
  return path
