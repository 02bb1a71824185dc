"""What ``python -m rl_jax.serve`` serves: a checkpoint directory's model, tokenizer, chat
format and tool-call format, each problem reported in one line.

``--model`` is a run's ``hf/`` (or ``hf_base/``), any supported Hugging Face checkpoint
(Llama, Qwen2/3, Qwen3-MoE, Gemma 3), or a PEFT adapter directory (``hf_adapter/``): its
``base_model_name_or_path`` is loaded and the adapters merged into it (W + (α/r)·A·B).

The tokenizer is the directory's own (``tokenizer.json``, or ``rl_jax_tokenizer.json`` that
an export of a character-tokenizer run writes) unless ``--tokenizer`` names one. The chat
format is the checkpoint's chat template (named templates: "tool_use"), or the built-in
compact format for the character tokenizer; without either, chat completions answer 400 and
text completions serve. The tool-call format (``--tool-parser``, "auto" by default) is the one
the chat template writes (``envs.tool_calls.template_format``), "compact" for the built-in
format.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import jax.numpy as jnp

from rl_jax import models
from rl_jax.data import tokenizers as tok_lib
from rl_jax.envs import chat as chat_lib
from rl_jax.envs import tool_calls
from rl_jax.errors import RLJaxError
from rl_jax.models.config import ModelConfig
from rl_jax.models.hf import PEFT_LORA_ALPHA

__all__ = ["ServeError", "ServedModel", "load_served"]

log = logging.getLogger(__name__)

_PEFT_TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
                 "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


class ServeError(RLJaxError, ValueError):
  """A server setting or checkpoint directory is wrong (one line)."""


@dataclasses.dataclass
class ServedModel:
  """A loaded checkpoint, ready for the scheduler.

  name: the model id clients send. cfg, params: the model (adapters merged). tokenizer:
  ``encode``/``decode``/``eos_id``. chat: the ChatFormat, or None (no chat template).
  parser: tool-call format name, or None (tools are refused). stop_ids: ids that end a
  completion (the chat format's end of turn and the tokenizer's eos).
  """

  name: str
  cfg: ModelConfig
  params: Any
  tokenizer: Any
  chat: chat_lib.ChatFormat | None
  parser: str | None
  stop_ids: tuple[int, ...]
  notes: tuple[str, ...] = ()


def _adapter_base(path: str) -> str | None:
  """The base checkpoint an adapter directory names, None for a plain checkpoint."""
  cfg_file = os.path.join(path, "adapter_config.json")
  if not os.path.isfile(cfg_file):
    return None
  try:
    with open(cfg_file, encoding="utf-8") as f:
      base = json.load(f).get("base_model_name_or_path")
  except (json.JSONDecodeError, AttributeError):
    raise ServeError(f"{cfg_file} is not a JSON object") from None
  if not base or not os.path.isdir(base):
    raise ServeError(f"{cfg_file}: base_model_name_or_path={base!r} is not a local "
                     "directory; serve the merged export (the run's hf/) instead")
  return base


def _lora_scale(acfg: dict) -> tuple[int, float]:
  """(r, lora_alpha) of an adapter_config.json (PEFT's alpha where it has none), one line if
  either is not a number."""
  r, alpha = acfg.get("r"), acfg.get("lora_alpha", PEFT_LORA_ALPHA)
  if not isinstance(r, int) or isinstance(r, bool) or r < 1:
    raise ServeError(f"adapter_config.json r={r!r} must be a positive integer")
  if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
    raise ServeError(f"adapter_config.json lora_alpha={alpha!r} must be a number")
  return r, float(alpha)


def _load_weights(path: str, dtype: str):
  """(cfg, params) of a checkpoint or adapter directory (adapters merged)."""
  base = _adapter_base(path)
  if base is None:
    return models.load_hf(path, dtype=jnp.dtype(dtype))
  with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
    acfg = json.load(f)
  targets = [m.split(".")[-1] for m in acfg.get("target_modules") or []]
  unknown = sorted(set(targets) - set(_PEFT_TARGETS))
  if unknown:
    raise ServeError(f"{path}: adapter target_modules {unknown} are not supported "
                     f"(supported: {sorted(_PEFT_TARGETS)})")
  rank, alpha = _lora_scale(acfg)
  cfg, base_params = models.load_hf(base, dtype=jnp.dtype(dtype))
  cfg = cfg.replace(lora_rank=rank, lora_alpha=alpha,
                    lora_targets=tuple(t for t in models.lora.LORA_TARGETS
                                       if t in {_PEFT_TARGETS[x] for x in targets}))
  adapters = models.load_hf_adapter(cfg, path, base)
  merged = models.lora.merge(cfg, models.lora.combine(base_params, adapters))
  return cfg.replace(lora_rank=0), merged


def _tokenizer(path: str, tokenizer: str | None):
  """The tokenizer of ``--tokenizer`` or of the checkpoint directory (one line if none)."""
  spec = tokenizer or path
  if tokenizer is None:
    for d in (path, _adapter_base(path)):
      if d and any(os.path.isfile(os.path.join(d, f))
                   for f in ("tokenizer.json", tok_lib.CHAR_TOKENIZER_FILE)):
        spec = d
        break
    else:
      raise ServeError(f"{path} has no tokenizer (tokenizer.json, or rl_jax_tokenizer.json "
                       "from an rl_jax export); pass --tokenizer=DIR, or --tokenizer=char for "
                       "the character tokenizer")
  try:
    return tok_lib.load_tokenizer(spec), spec
  except (OSError, ValueError) as e:
    raise ServeError(f"--tokenizer={spec}: {' '.join(str(e).split())}") from None


def _chat_format(spec: str, tokenizer) -> tuple[chat_lib.ChatFormat | None, str | None]:
  """(ChatFormat or None, the reason there is none)."""
  if isinstance(tokenizer, tok_lib.CharTokenizer):
    return chat_lib.ChatFormat.builtin(tokenizer), None
  try:
    return chat_lib.ChatFormat.from_pretrained(spec, tokenizer, with_tools=True), None
  except (OSError, ValueError) as e:
    return None, " ".join(str(e).split())


def _check_names(name: str | None, tool_parser: str) -> None:
  """One line for an empty model id or an unknown tool-call format (before loading)."""
  if name is not None and not name.strip():
    raise ServeError(f"--served-model-name={name!r} must not be empty (unset: the "
                     "directory's name)")
  if tool_parser != "auto" and tool_parser not in tool_calls.PARSERS:
    raise ServeError(f"--tool-parser={tool_parser!r}: choose auto or one of "
                     f"{sorted(tool_calls.PARSERS)}")


def load_served(path: str, *, tokenizer: str | None = None, name: str | None = None,
                dtype: str = "float32", tool_parser: str = "auto") -> ServedModel:
  """Load what ``path`` serves (module docstring); ServeError (one line) when it cannot."""
  if not os.path.isdir(path):
    raise ServeError(f"--model={path} is not a directory")
  _check_names(name, tool_parser)
  if not (os.path.isfile(os.path.join(path, "config.json"))
          or os.path.isfile(os.path.join(path, "adapter_config.json"))):
    raise ServeError(f"--model={path} has no config.json (nor adapter_config.json): pass a "
                     "run's hf/ directory or a Hugging Face checkpoint")
  tok, spec = _tokenizer(path, tokenizer)
  try:
    cfg, params = _load_weights(path, dtype)
  except RLJaxError as e:
    raise ServeError(f"--model={path}: {e}") from None
  if tok.vocab_size > cfg.vocab_size:
    raise ServeError(f"the tokenizer of {spec} has {tok.vocab_size} ids, more than the "
                     f"model's vocabulary of {cfg.vocab_size}")
  fmt, why = _chat_format(spec, tok)
  notes = [] if fmt else [f"no chat template in {spec} ({why}): /v1/chat/completions answers "
                          "400; /v1/completions serves"]
  parser = None
  if fmt is not None:
    parser = tool_parser
    if tool_parser == "auto":
      parser = ("compact" if fmt.name == "builtin"
                else tool_calls.template_format(fmt.source))
    if parser is None:
      notes.append(f"the chat template of {spec} shows no tool-call format: requests with "
                   "tools answer 400 (set --tool-parser=hermes or llama3)")
  stop = tuple(fmt.end_of_turn_ids) if fmt is not None else (int(tok.eos_id),)
  name = name or os.path.basename(os.path.normpath(path))
  return ServedModel(name, cfg, params, tok, fmt, parser, stop, tuple(notes))
