"""Tokenizers with one small interface: a built-in character tokenizer and a HF wrapper.

Both classes expose ``encode(text) -> list[int]``, ``decode(ids) -> str`` (stops at the first
eos, drops pad), and the integer attributes ``vocab_size``, ``pad_id``, ``eos_id`` and
``bos_id`` (``bos_id`` may be None for HF models without one). ``encode_prompt(tok, text)``
is how the trainer encodes a prompt: after a bos where the tokenizer prepends one
(``add_bos``: HF tokenizers as ``transformers``' ``tokenizer(text)`` does, e.g. Gemma and
Llama; never Qwen or the char tokenizer).

Usage::

    tok = load_tokenizer("char")                  # synthetic tasks, tiny models
    tok = load_tokenizer("/models/Qwen2.5-0.5B")  # a directory with tokenizer.json
    save_tokenizer("char", "/runs/r1/hf")        # what load_tokenizer("/runs/r1/hf") reads

An exported checkpoint carries its tokenizer (``save_tokenizer``): the HF files copied from
the source directory, or for the character tokenizer the file ``rl_jax_tokenizer.json``
(its character set and the built-in chat format), so a served or evaluated export needs no
other path.
"""

from __future__ import annotations

import json
import os
import shutil
import string
from typing import Any, Iterable, Protocol

__all__ = [
    "BOS", "CHARS", "CHAR_TOKENIZER_FILE", "EOS", "PAD", "CharTokenizer", "HFTokenizer",
    "TOKENIZER_FILES", "Tokenizer", "encode_prompt", "load_tokenizer", "save_tokenizer",
]

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"

# Fixed character set: order defines the ids, so never reorder (append only).
CHARS = (string.digits + string.ascii_lowercase + string.ascii_uppercase
         + " +-*/=()<>[]{}.,:;?!'\"#%&^_|\\~@$`\n")


class Tokenizer(Protocol):
  """What the trainer needs from a tokenizer."""

  vocab_size: int
  pad_id: int
  eos_id: int
  bos_id: int | None

  def encode(self, text: str) -> list[int]:
    ...

  def decode(self, ids: Iterable[int]) -> str:
    ...


class CharTokenizer:
  """Deterministic character-level tokenizer: pad=0, bos=1, eos=2, then ``CHARS``.

  Meant for the synthetic tasks in ``rl_jax.data.tasks``; every prompt and answer they
  produce is in the vocabulary.
  """

  add_bos = False  # prompts are encoded without a bos (encode_prompt)

  def __init__(self):
    self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
    self._specials = (PAD, BOS, EOS)
    self._id_of = {c: i + len(self._specials) for i, c in enumerate(CHARS)}
    self._char_of = {i: c for c, i in self._id_of.items()}
    self.vocab_size = len(self._specials) + len(CHARS)

  def vocab(self) -> dict[str, int]:
    """Token string -> id, the special tokens included."""
    return {**{t: i for i, t in enumerate(self._specials)}, **self._id_of}

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Map each character to its id.

    Args:
      text: the string to encode.
      add_bos: prepend ``bos_id``.
      add_eos: append ``eos_id``.

    Returns:
      A list of ints.

    Raises:
      ValueError: if ``text`` holds a character outside the vocabulary.
    """
    ids = [self.bos_id] if add_bos else []
    for pos, ch in enumerate(text):
      i = self._id_of.get(ch)
      if i is None:
        raise ValueError(f"character {ch!r} at position {pos} is not in the char tokenizer "
                         "vocabulary")
      ids.append(i)
    if add_eos:
      ids.append(self.eos_id)
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Inverse of ``encode``: stops at the first eos, skips pad and bos.

    Args:
      ids: token ids (ints or numpy integers).

    Returns:
      The decoded string.

    Raises:
      ValueError: on an id outside ``[0, vocab_size)``.
    """
    out = []
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      if i in (self.pad_id, self.bos_id):
        continue
      ch = self._char_of.get(i)
      if ch is None:
        raise ValueError(f"token id {i} is outside the char vocabulary (size {self.vocab_size})")
      out.append(ch)
    return "".join(out)


def _token_content(value: Any) -> str | None:
  """A special token in tokenizer_config.json is a string or a dict with "content"."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


# Used to find an eos when the model directory does not name one.
_EOS_FALLBACKS = ("<|endoftext|>", "<|im_end|>", "</s>", "<eos>", "<|end_of_text|>")


class HFTokenizer:
  """A ``tokenizers.Tokenizer`` loaded from ``<model_dir>/tokenizer.json``.

  Special ids come from ``tokenizer_config.json`` (``eos_token``, ``pad_token``,
  ``bos_token``), else ``generation_config.json``/``config.json`` (``eos_token_id``), else
  a common eos string present in the vocabulary. pad falls back to eos.

  ``add_bos``: prompts start with ``bos_id`` (``encode_prompt``), as ``transformers``
  encodes text: ``add_bos_token`` of ``tokenizer_config.json`` where set (Gemma, Llama 2),
  else whether the tokenizer.json post-processor prepends the bos (Llama 3); False without a
  bos token (Qwen).
  """

  def __init__(self, model_dir: str):
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"no tokenizer.json in {model_dir!r}")
    import tokenizers  # the HF library (absolute import; not this module)

    self._tok = tokenizers.Tokenizer.from_file(path)
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    cfg = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    self.eos_id = self._special_id(cfg.get("eos_token"))
    if self.eos_id is None:
      for name in ("generation_config.json", "config.json"):
        eos = _read_json(os.path.join(model_dir, name)).get("eos_token_id")
        if isinstance(eos, list) and eos:
          eos = eos[0]
        if isinstance(eos, int):
          self.eos_id = eos
          break
    if self.eos_id is None:
      for tok in _EOS_FALLBACKS:
        if self._tok.token_to_id(tok) is not None:
          self.eos_id = self._tok.token_to_id(tok)
          break
    if self.eos_id is None:
      raise ValueError(f"cannot determine the eos token of the tokenizer in {model_dir!r}; "
                       "set eos_token in tokenizer_config.json")
    pad = self._special_id(cfg.get("pad_token"))
    self.pad_id = self.eos_id if pad is None else pad
    self.bos_id = self._special_id(cfg.get("bos_token"))
    if self.bos_id is None:
      self.add_bos = False
    elif isinstance(cfg.get("add_bos_token"), bool):
      self.add_bos = cfg["add_bos_token"]
    else:
      self.add_bos = self._tok.encode("x", add_special_tokens=True).ids[:1] == [self.bos_id]

  def vocab(self) -> dict[str, int]:
    """Token string -> id, the added tokens included."""
    return dict(self._tok.get_vocab(with_added_tokens=True))

  def _special_id(self, value: Any) -> int | None:
    content = _token_content(value)
    return None if content is None else self._tok.token_to_id(content)

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text`` (no bos/eos unless ``add_special_tokens``).

    Args:
      text: the string to encode.
      add_special_tokens: apply the tokenizer's post-processor (e.g. a bos).

    Returns:
      A list of ints.
    """
    return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

  def decode(self, ids: Iterable[int]) -> str:
    """Decode up to the first eos, dropping pad and other special tokens.

    Args:
      ids: token ids.

    Returns:
      The decoded string.
    """
    kept = []
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      if i != self.pad_id:
        kept.append(i)
    return self._tok.decode(kept, skip_special_tokens=True)


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
  """A prompt's ids as the model reads it: ``tokenizer.encode(text)``, after ``bos_id`` when
  the tokenizer's ``add_bos`` is set (tokenizers without the attribute: none)."""
  ids = list(tokenizer.encode(text))
  if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None:
    return [tokenizer.bos_id] + ids
  return ids


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    try:
      data = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} is not valid JSON: {e}") from None
  return data if isinstance(data, dict) else {}


CHAR_TOKENIZER_FILE = "rl_jax_tokenizer.json"
# what a checkpoint directory's tokenizer and chat template are made of (copied when present)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json",
                   "tokenizer.model", "vocab.json", "merges.txt")


def save_tokenizer(spec: str, dirpath: str) -> list[str]:
  """Write the tokenizer ``spec`` names (as ``load_tokenizer`` takes it) into ``dirpath``.

  "char" writes ``rl_jax_tokenizer.json`` (the character set; its chat format is the
  built-in one); a directory has its ``TOKENIZER_FILES`` copied. Returns the files written.
  """
  os.makedirs(dirpath, exist_ok=True)
  if spec == "char":
    with open(os.path.join(dirpath, CHAR_TOKENIZER_FILE), "w", encoding="utf-8") as f:
      json.dump({"tokenizer": "char", "chars": CHARS, "chat_format": "builtin"}, f, indent=2)
    return [CHAR_TOKENIZER_FILE]
  written = []
  for name in TOKENIZER_FILES:
    src = os.path.join(spec, name)
    if os.path.isfile(src) and not os.path.exists(os.path.join(dirpath, name)):
      shutil.copyfile(src, os.path.join(dirpath, name))
      written.append(name)
  return written


def load_tokenizer(spec: str) -> CharTokenizer | HFTokenizer:
  """Build a tokenizer from a config string.

  Args:
    spec: ``"char"`` for the built-in character tokenizer, or a local model directory
      holding ``tokenizer.json`` (or an export of the character tokenizer,
      ``rl_jax_tokenizer.json``).

  Returns:
    A tokenizer with the interface described in the module docstring.

  Raises:
    FileNotFoundError: if ``spec`` is neither "char" nor an existing directory.
  """
  if spec == "char":
    return CharTokenizer()
  if not os.path.isdir(spec):
    raise FileNotFoundError(f"tokenizer spec {spec!r} is neither 'char' nor a directory")
  marker = os.path.join(spec, CHAR_TOKENIZER_FILE)
  if not os.path.isfile(os.path.join(spec, "tokenizer.json")) and os.path.isfile(marker):
    if _read_json(marker).get("chars") != CHARS:
      raise ValueError(f"{marker} names a character set this version does not have")
    return CharTokenizer()
  return HFTokenizer(spec)
