"""Model-judged rewards (``reward.judge_path``, ``reward.judge_template``): a frozen Hugging
Face causal LM reads a prompt rendered from each row's question, completion and reference,
and its verdict is the row's training reward (LLM-as-a-judge, Zheng et al. 2023, "Judging
LLM-as-a-Judge with MT-Bench and Chatbot Arena"; a generative reward model, Mahan et al.
2024, "Generative Reward Models").

* ``make_judge(reward, dtype)``: at setup, everything but the weights: the directory's
  ``config.json`` (its ModelConfig) and ``tokenizer.json``, the template (compiled and
  rendered once with dummy values), the verdict reader and, for ``yes_no``, the verdict token
  ids. Each problem is one ``ConfigError`` line. The weights are read on the first
  ``Judge.verdicts`` call, so dry runs and memory plans never load them.
* ``reward.judge_verdict``:
  - ``"yes_no"``: one forward pass over the rendered prompts (right-padded; the logits at each
    prompt's last token). ``Y`` is the set of first token ids of ``" yes"`` and ``"yes"``,
    ``N`` that of ``" no"`` and ``"no"`` (as the judge's tokenizer encodes them, without a
    bos; a candidate whose first token does not decode to a prefix of the word, e.g. an
    unknown token, is dropped). The reward is ``P(yes) / (P(yes) + P(no))`` with
    ``P(yes) = Σ_{i∈Y} softmax(z)_i``: ``sigmoid(logsumexp z_Y - logsumexp z_N)``, in [0,1].
  - ``"score"``: greedy decoding of up to ``reward.judge_max_tokens`` tokens (stopping at the
    judge's eos); the reward is the first number in the decoded text (``parse_score``), not
    clipped. A continuation without a number is NaN here: reward 0, counted as a reward
    exception (``as_values``).

The judge runs on this process's default device, unsharded, in ``model.dtype``; it is not in
the checkpoint (a resumed run reads it again) and not in the memory plan.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import jinja2
import jinja2.sandbox
import numpy as np

from rl_jax import models
from rl_jax import rollout
from rl_jax import settings
from rl_jax.data import tokenizers as tok_lib
from rl_jax.errors import ConfigError, ModelError, RLJaxError

__all__ = ["Judge", "make_judge", "compile_template", "verdict_ids", "parse_score",
           "as_values", "yes_no_verdicts", "NO_VERDICT", "TOKENS_PER_CALL", "DUMMY"]

# rows x padded length of one ``yes_no`` forward call (fewer rows for longer prompts)
TOKENS_PER_CALL = 1 << 14
# the values the template is rendered with once at setup
DUMMY = dict(question="What is 2 + 2?", answer="2 + 2 = 4", reference="4")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)")
# why a row gets no verdict, per reward.judge_verdict (the note a failing judge prints)
NO_VERDICT = {"yes_no": "P(yes) + P(no) of the judge's next token is 0 or not finite",
              "score": "the judge's greedy continuation holds no number"}


def _pow2(x: int, lo: int = 1) -> int:
  """The smallest power of two >= max(x, lo) (shape buckets)."""
  return max(lo, 1 << max(0, int(x) - 1).bit_length())


def compile_template(source: str) -> jinja2.Template:
  """The judge template in an immutable sandbox; an undefined variable is an error
  (``StrictUndefined``), and a single trailing newline of the file is dropped (jinja2's
  default)."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined)
  return env.from_string(source)


def _jinja_line(e: BaseException) -> str:
  """A jinja2 (or render-time) error as one line, with its template line where known."""
  where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
  return f"{type(e).__name__}{where}: {' '.join(str(e).split())}"


def _read_template(path: str) -> jinja2.Template:
  """The compiled template at ``path``, rendered once with ``DUMMY``; one ConfigError line."""
  where = f"reward.judge_template={path}"
  if not os.path.isfile(path):
    raise ConfigError(f"{where}: no such file")
  try:
    with open(path, encoding="utf-8") as f:
      source = f.read()
  except UnicodeDecodeError as e:
    raise ConfigError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start})") from None
  try:
    template = compile_template(source)
    text = template.render(**DUMMY)
    other = template.render(**{**DUMMY, "answer": DUMMY["answer"] + " (another answer)"})
  except Exception as e:  # noqa: BLE001 -- any template failure is the user's one line
    raise ConfigError(f"{where} does not render: {_jinja_line(e)}") from None
  if not text.strip():
    raise ConfigError(f"{where} renders an empty prompt")
  if other == text:  # e.g. {answer}, a format string's field, which jinja2 prints as it is
    raise ConfigError(f"{where} never shows the judge the answer, so every row would get the "
                      "same verdict: write it as {{ answer }} (jinja2)")
  return template


def verdict_ids(tokenizer, word: str) -> tuple[int, ...]:
  """The distinct first token ids of ``" " + word`` and ``word`` (no bos) whose token decodes
  to a non-empty prefix of ``word`` (stripped); () when neither does (e.g. an unknown
  token)."""
  ids = []
  for text in (" " + word, word):
    enc = tokenizer.encode(text)
    if not enc or enc[0] in ids:
      continue
    piece = tokenizer.decode([enc[0]]).strip()
    if piece and word.startswith(piece):
      ids.append(enc[0])
  return tuple(ids)


def parse_score(text: str) -> float:
  """The first number in ``text`` (an optional sign, digits with an optional fraction, or a
  fraction alone: "7", "-2", "0.75", ".5"); NaN when there is none."""
  m = _NUMBER.search(text)
  return float(m.group()) if m else float("nan")


def as_values(verdicts: np.ndarray, why: str = "") -> tuple[list[float | None], dict[str, int]]:
  """Verdicts float [B] as reward values (None where NaN: reward 0) and the counters
  ``{"exceptions": rows without a verdict, "timeouts": 0}``, as ``rewards.verify_rows``
  (``why``, the reason a row has none, in ``"errors"`` when one has none)."""
  values = [None if math.isnan(float(v)) else float(v) for v in verdicts]
  stats = {"exceptions": sum(v is None for v in values), "timeouts": 0}
  if stats["exceptions"] and why:
    stats["errors"] = [why]
  return values, stats


def yes_no_verdicts(cfg, params, tokens: jax.Array, lengths: jax.Array,
                    yes: tuple[int, ...], no: tuple[int, ...]) -> jax.Array:
  """float32 [B] ``P(yes)/(P(yes)+P(no))`` of the next token after each prompt: ``tokens``
  int32 [B,T] right-padded prompts of int32 [B] ``lengths``; ``yes`` / ``no`` token ids."""
  hidden = models.hidden_states(cfg, params, tokens)  # [B,T,D]; causal, so padding is unseen
  last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B,D]
  logits = models.logits_from_hidden(cfg, params, last)  # [B,V] float32
  lse = lambda ids: jax.nn.logsumexp(logits[:, jnp.asarray(ids)], axis=-1)
  return jax.nn.sigmoid(lse(yes) - lse(no))


_yes_no_jit = jax.jit(yes_no_verdicts, static_argnums=(0, 4, 5))


class Judge:
  """A judge model with its template and verdict reader; weights read on first use.

  ``verdicts(questions, completions, references)`` -> float32 [B], NaN where the ``score``
  reader found no number (see the module docstring).
  """

  def __init__(self, path: str, cfg, tokenizer, template: jinja2.Template, verdict: str,
               max_tokens: int, yes: tuple[int, ...] = (), no: tuple[int, ...] = ()):
    self.path, self.cfg, self.tokenizer, self.template = path, cfg, tokenizer, template
    self.verdict, self.max_tokens, self.yes, self.no = verdict, max_tokens, yes, no
    self._params = None

  @property
  def params(self) -> Any:
    """The judge's weights on the default device (read from ``path`` on first access)."""
    if self._params is None:
      try:
        _, self._params = models.load_hf(self.path, dtype=jnp.dtype(self.cfg.param_dtype))
      except (ModelError, ValueError, KeyError, OSError) as e:
        raise RLJaxError(f"reward.judge_path={self.path}: {' '.join(str(e).split())}") from None
    return self._params

  def prompts(self, questions: Sequence[str], completions: Sequence[str],
              references: Sequence[str]) -> list[list[int]]:
    """B rendered, tokenized judge prompts (a bos first where the tokenizer adds one).

    Raises:
      RLJaxError: one line: the template fails on a row, or a prompt does not fit the
        judge's positions (with the decoded tokens for ``score``).
    """
    if not len(questions) == len(completions) == len(references):
      raise ValueError(f"{len(questions)} questions, {len(completions)} completions, "
                       f"{len(references)} references")
    room = self.cfg.max_position_embeddings - (self.max_tokens if self.verdict == "score" else 0)
    out = []
    for i, (q, a, r) in enumerate(zip(questions, completions, references)):
      try:
        text = self.template.render(question=q, answer=a, reference=r)
      except Exception as e:  # noqa: BLE001
        raise RLJaxError(f"reward.judge_template: rendering row {i} failed: "
                         f"{_jinja_line(e)}") from None
      ids = tok_lib.encode_prompt(self.tokenizer, text)
      if not ids or len(ids) > room:
        raise RLJaxError(f"reward.judge_path={self.path}: the judge prompt of row {i} has "
                         f"{len(ids)} tokens; the judge reads 1 to {room}")
      out.append(ids)
    return out

  def verdicts(self, questions: Sequence[str], completions: Sequence[str],
               references: Sequence[str]) -> np.ndarray:
    """float32 [B] rewards of B (question, completion, reference) rows (NaN: no verdict)."""
    prompts = self.prompts(questions, completions, references)
    if self.verdict == "yes_no":
      return self._yes_no(prompts)
    return self._score(prompts)

  def _yes_no(self, prompts: list[list[int]]) -> np.ndarray:
    """One padded forward pass per chunk: T the prompts' length rounded up to a power of two
    (>= 16, at most the judge's positions), chunks of a power-of-two number of rows."""
    T = min(_pow2(max(len(p) for p in prompts), 16), self.cfg.max_position_embeddings)
    rows = min(_pow2(len(prompts)), max(1, 1 << ((TOKENS_PER_CALL // T).bit_length() - 1)))
    out = np.zeros(len(prompts), np.float32)
    pad = self.tokenizer.pad_id
    for start in range(0, len(prompts), rows):
      chunk = prompts[start:start + rows]
      tokens = np.full((rows, T), pad, np.int32)
      lengths = np.ones(rows, np.int32)
      for i, p in enumerate(chunk):
        tokens[i, :len(p)], lengths[i] = p, len(p)
      got = _yes_no_jit(self.cfg, self.params, jnp.asarray(tokens), jnp.asarray(lengths),
                        self.yes, self.no)
      out[start:start + len(chunk)] = np.asarray(got)[:len(chunk)]
    return out

  def continuations(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """The judge's greedy continuation of each prompt: up to ``max_tokens`` token ids, an
    eos it stops at included."""
    r = rollout.generate(self.cfg, self.params, prompts, n=1, max_new_tokens=self.max_tokens,
                         temperature=0.0, eos_id=self.tokenizer.eos_id, seed=0)
    return [[int(t) for t, m in zip(row, mrow) if m]
            for row, mrow in zip(np.asarray(r.tokens), np.asarray(r.mask))]

  def _score(self, prompts: list[list[int]]) -> np.ndarray:
    """Greedy continuations (``continuations``), each decoded and read by ``parse_score``."""
    return np.asarray([parse_score(self.tokenizer.decode(ids))
                       for ids in self.continuations(prompts)], np.float32)


def make_judge(rc: settings.RewardSettings, dtype: str) -> Judge | None:
  """The run's judge from the reward settings ``rc`` (None without ``judge_path``), weights
  unread, computing in ``dtype`` (``model.dtype``).

  Raises:
    ConfigError: one line: the directory, its ``config.json`` or ``tokenizer.json`` is
      missing or unreadable, the template is missing or does not render, or (``yes_no``) the
      tokenizer has no token for "yes" or "no", or the same one for both.
  """
  path = rc.judge_path or ""
  if not path:
    return None
  where = f"reward.judge_path={path}"
  if not os.path.isdir(path):
    raise ConfigError(f"{where}: no such directory")
  for name in ("config.json", "tokenizer.json"):
    if not os.path.isfile(os.path.join(path, name)):
      raise ConfigError(f"{where}: the directory has no {name} (a Hugging Face checkpoint "
                        "with config.json, safetensors weights and tokenizer.json)")
  try:
    cfg = models.read_hf_config(path, dtype=dtype, param_dtype=dtype)
  except (ModelError, ValueError, KeyError) as e:
    raise ConfigError(f"{where}: {' '.join(str(e).split())}") from None
  try:
    tokenizer = tok_lib.load_tokenizer(path)
  except (OSError, ValueError) as e:
    raise ConfigError(f"{where}: cannot read its tokenizer: {' '.join(str(e).split())}") from None
  if tokenizer.vocab_size > cfg.vocab_size:
    raise ConfigError(f"{where}: its tokenizer has {tokenizer.vocab_size} tokens but the model "
                      f"only {cfg.vocab_size} (config.json vocab_size): not the judge's own "
                      "tokenizer?")
  template = _read_template(rc.judge_template)
  verdict = rc.judge_verdict or "yes_no"
  yes = no = ()
  if verdict == "yes_no":
    yes, no = verdict_ids(tokenizer, "yes"), verdict_ids(tokenizer, "no")
    for word, ids in (("yes", yes), ("no", no)):
      if not ids:
        raise ConfigError(f"{where}: the judge's tokenizer has no token for {word!r} (neither "
                          f"{' ' + word!r} nor {word!r} starts with one); reward.judge_verdict="
                          "yes_no reads the next-token probabilities of yes and no")
    if set(yes) & set(no):
      raise ConfigError(f"{where}: the judge's tokenizer starts 'yes' and 'no' with the same "
                        "token; reward.judge_verdict=yes_no cannot tell them apart")
  return Judge(path, cfg, tokenizer, template, verdict, int(rc.judge_max_tokens), yes, no)
