"""Host-side records of the rollout engine: prompts, groups, samples, the returned
``Rollout``, and validation of the engine's arguments.

Axis letters: the legend of ``rl_jax/__init__.py`` (G groups, M samples per group,
B = G·M rows); local letters as in ``sampling``: z stop sequences, w stop window, e eos ids.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np

from rl_jax.errors import RLJaxError
from rl_jax.models.config import ModelConfig
from rl_jax.rollout import sampling
from rl_jax.rollout import kv_cache, pages
from rl_jax.rollout.kv_cache import REASON_NAMES

__all__ = ["REASON_CODES", "GroupRequest", "Prompt", "Rollout", "RolloutError", "Sample",
           "as_ids", "assemble", "check_int", "check_power_of_two", "check_prompt",
           "fixed_pool_pages", "padded_routing", "PoolPlan", "pool_plan", "pow2",
           "sampling_params"]

REASON_CODES = {name: code for code, name in REASON_NAMES.items()}


class RolloutError(RLJaxError, ValueError):
  """A rollout argument is invalid (prompt, budget, sampling setting, stop token ...)."""


@dataclasses.dataclass
class Sample:
  """One trajectory (possibly partial). Lists are aligned token by token."""

  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None  # None while unfinished
  # mixture of experts: int32 [len(tokens),Y,X] experts of each token (-1: not recorded)
  routing: np.ndarray | None = None


@dataclasses.dataclass
class Prompt:
  """A prompt with a caller's tag (e.g. its dataset index), returned with its group."""

  tokens: Sequence[int]
  meta: Any = None


@dataclasses.dataclass
class GroupRequest:
  """A prompt and its n samples; ``uid`` identifies its PRNG streams."""

  uid: int
  prompt: list[int]
  samples: list[Sample]
  resumed: int = 0  # how many times this group was aborted and resumed
  meta: Any = None  # the caller's tag (``Prompt.meta``)

  @property
  def done(self) -> bool:
    return all(s.finish_reason is not None for s in self.samples)

  @property
  def started(self) -> bool:
    return any(s.tokens for s in self.samples)


@dataclasses.dataclass
class Rollout:
  """Sampled responses, one row per sample, prompt-major (prompt 0's n samples first).

  Attributes (B = G·M rows, R = max_new_tokens):
    tokens: int32 [B,R] (0 after the end). mask: bool [B,R], True for generated tokens up to
      and including EOS / the stop sequence.
    logprobs: float32 [B,R] log-prob of each token under the distribution it was sampled
      from (after temperature/top-k/top-p; 0 for greedy and padding).
    versions: int32 [B,R] policy version that sampled each token (-1 on padding).
    lengths: int32 [B]. finish_reason: str [B], one of "eos", "stop", "length".
    prompt_index: int32 [B] the row's prompt (index into ``prompts``).
    prompts: list of the G prompts (token-id lists). group_ids: int [G] request uids.
    stats: dict of scalars (tokens, kv bytes, aborted groups, off-policy token fraction ...).
    group_meta: the caller's tag of each group (``Prompt.meta``; None for plain prompts).
    routing: mixture-of-experts models: int32 [B,R,Y,X] the experts each MoE layer chose
      for each token when the sampler fed it (-1 where none was recorded: the last token of
      a sample and padding); None for dense models.
  """

  tokens: np.ndarray
  mask: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  lengths: np.ndarray
  finish_reason: np.ndarray
  prompt_index: np.ndarray
  prompts: list[list[int]]
  group_ids: np.ndarray
  stats: dict[str, float]
  group_meta: list = dataclasses.field(default_factory=list)
  routing: np.ndarray | None = None


def pow2(x: int, lo: int = 1) -> int:
  """The smallest power of two >= max(x, lo) (shape buckets)."""
  return max(lo, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


def as_ids(values, what: str, vocab: int) -> list[int]:
  """``values`` (a list or 1-D array of integers; whole-valued floats pass) as a list of
  token ids in [0, vocab); raises RolloutError naming ``what``."""
  try:
    arr = np.asarray(values)
  except (TypeError, ValueError):  # ragged
    arr = np.asarray(None)  # 0-d: refused below
  if arr.ndim == 1 and arr.dtype == object and all(
      isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in arr):
    ids = [int(t) for t in arr]  # Python ints past int64: the range check below names them
  elif arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iuf"):
    raise RolloutError(f"{what} must be a sequence of integer token ids")
  elif arr.dtype.kind == "f":
    whole = np.isfinite(arr) & (arr == np.floor(arr))
    if not whole.all():
      raise RolloutError(f"{what} has token id {float(arr[~whole][0])}, which is not an integer")
    ids = arr.astype(np.int64).tolist()
  else:
    ids = arr.tolist()
  bad = [t for t in ids if not 0 <= t < vocab]
  if bad:
    raise RolloutError(f"{what} has token id {bad[0]} outside the vocabulary [0, {vocab})")
  return ids


def check_prompt(prompt, index: int, cfg: ModelConfig, max_new_tokens: int,
                 context: int) -> list[int]:
  """Validated token-id list; raises RolloutError naming the prompt."""
  if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
    raise RolloutError(f"prompt {index} must be a list of token ids, got {type(prompt).__name__}")
  ids = as_ids(prompt, f"prompt {index}", cfg.vocab_size)
  if not ids:
    raise RolloutError(f"prompt {index} is empty; every prompt needs at least one token")
  if len(ids) + max_new_tokens > context:
    raise RolloutError(f"prompt {index} has {len(ids)} tokens; with max_new_tokens="
                       f"{max_new_tokens} it exceeds the context of {context} positions")
  return ids


def in_flight_budget(k_groups: int, ready: int, over_sampling: float,
                     max_staleness: int | None) -> int:
  """New or held groups an APRIL call submits to return ``k_groups`` complete ones when
  ``ready`` complete groups are already at hand: ceil(over_sampling·k_groups) in flight, at
  most (η + 1)·k_groups under the staleness bound η (AReaL's capacity (η + v + 1)·k −
  (accepted + running) with k groups accepted per version), less the ready ones; 0 when the
  ready ones suffice."""
  if ready >= k_groups:
    return 0
  in_flight = math.ceil(over_sampling * k_groups)
  if max_staleness is not None:
    in_flight = min(in_flight, (max_staleness + 1) * k_groups)
  return in_flight - ready


def check_int(name: str, value, lo: int):
  """Raises RolloutError unless ``value`` is an integer >= ``lo``."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
    raise RolloutError(f"{name} must be an integer >= {lo}, got {value!r}")


class PoolPlan(NamedTuple):
  """An engine's response pool (``pool_plan``): ``S`` tokens per page, ``NP`` = R / S
  page-table entries per sample, ``pages`` its first size, ``most`` its largest (a fixed
  pool's size, or every sample's whole budget for a growing one), whether it is ``fixed``
  (preempts when it runs out) or grows (doubling, never preempts), and its ``sequence``
  shards Q (``kv_cache.sequence_shards``)."""

  S: int
  NP: int
  pages: int
  most: int
  fixed: bool
  sequence: int = 1

  def in_place(self, pool_pages: int) -> bool:
    """Whether a pool of ``pool_pages`` gets the identity page table, its pages read in
    place (``pages.identity_table``): a growing pool at every sample's whole budget, not
    split over sequence shards (there a sample's pages go round-robin)."""
    return not self.fixed and pool_pages == self.most and self.sequence == 1


def pool_plan(cfg: ModelConfig, *, G: int, M: int, R: int, page_size: int, kv_pages,
              kv_memory_fraction, devices, budget: str, shards: int = 1,
              sequence: int = 1) -> PoolPlan:
  """The response pool of an engine of G slots x M samples with an R-token response cache:
  pages of ``page_size`` tokens (a power of two; at most R), fixed (``kv_pages`` per device,
  or ``kv_memory_fraction`` of the devices' free memory: ``fixed_pool_pages``) or growing
  from room for 256 tokens per sample. ``budget`` names the response budget in errors. The
  plan's page counts are the whole pool's: its ``shards`` (``kv_cache.pool_shards``) x Q
  devices hold one shard each, so a fixed pool has ``shards`` x Q x the pages per device.
  Q is ``sequence`` (the devices of the mesh's sequence axes) when it divides the NP
  entries of a sample's table, else 1 (``kv_cache.sequence_shards``); with Q > 1 a
  sample's entries go round-robin over Q devices, so one group needs M·NP/Q pages of each.

  Raises:
    RolloutError: one line, for a page size that is not a power of two, a value out of
      range, or a fixed pool smaller than one group.
  """
  check_power_of_two("page_size", page_size)
  S = min(int(page_size), R)
  NP = R // S
  sequence = sequence if NP % sequence == 0 else 1
  shards *= sequence
  whole = G * M * NP
  fixed = fixed_pool_pages(cfg, kv_pages, kv_memory_fraction, devices, M=M, NP=NP // sequence,
                           S=S, whole=whole // shards, budget=budget)
  if fixed is not None:
    return PoolPlan(S, NP, fixed * shards, fixed * shards, True, sequence)
  return PoolPlan(S, NP, min(whole, G * M * pages.pages_needed(min(R, 256), S)), whole, False,
                  sequence)


def fixed_pool_pages(cfg: ModelConfig, kv_pages, kv_memory_fraction, devices, *, M: int,
                     NP: int, S: int, whole: int, budget: str) -> int | None:
  """The pages per device of an engine's fixed response pool, or None for a growing one.

  ``kv_pages`` as given; else ``kv_memory_fraction`` of the free memory ``devices`` report
  (``pages.pages_from_memory``; None where they report none, e.g. CPU), at most ``whole``
  (every budget of a device's samples). Either must hold one group: M samples x NP pages of S
  tokens.
  ``budget`` names the response budget in the error (e.g. "max_new_tokens=512").

  Raises:
    RolloutError: one line, for a value out of range or a pool smaller than one group.
  """
  if kv_pages is None and kv_memory_fraction is not None:
    if not 0.0 < float(kv_memory_fraction) <= 1.0:
      raise RolloutError(f"kv_memory_fraction must lie in (0, 1], got {kv_memory_fraction!r}")
    fit = pages.pages_from_memory(devices, float(kv_memory_fraction),
                                  kv_cache.pool_bytes(cfg, 1, S))
    if fit is not None:
      if fit < M * NP:
        raise RolloutError(f"kv_memory_fraction={kv_memory_fraction} leaves room for {fit} "
                           f"pages of {S} tokens; one group needs {M * NP}")
      kv_pages = min(fit, whole)
  if kv_pages is None:
    return None
  check_int("kv_pages", kv_pages, 1)
  if kv_pages < M * NP:
    raise RolloutError(f"kv_pages={kv_pages} is smaller than one group needs: {M} samples x "
                       f"{NP} pages of {S} tokens ({budget})")
  return int(kv_pages)


def check_power_of_two(name: str, value):
  """Raises RolloutError unless ``value`` is a positive power of two."""
  if (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1
      or value & (value - 1)):
    raise RolloutError(f"{name} must be a positive power of two, got {value!r}")


def sampling_params(cfg: ModelConfig, temperature, top_k, top_p, eos_id, stop):
  """SamplingParams (device arrays) and the static ``filtered`` flag; validates ids."""
  if eos_id is None:
    eos = [-1]
  elif isinstance(eos_id, (int, np.integer)):
    eos = as_ids([eos_id], "eos_id", cfg.vocab_size)
  else:
    eos = as_ids(eos_id, "eos_id", cfg.vocab_size) or [-1]
  if stop is not None and (isinstance(stop, (str, bytes)) or not hasattr(stop, "__iter__")):
    raise RolloutError(f"stop must be a list of stop sequences (token-id lists), got {stop!r}")
  seqs = []
  for i, seq in enumerate(stop or []):
    if isinstance(seq, (int, np.integer)):
      seq = [seq]
    ids = as_ids(seq, f"stop sequence {i}", cfg.vocab_size)
    if not ids:
      raise RolloutError(f"stop sequence {i} is empty")
    seqs.append(ids)
  w = pow2(max([len(s) for s in seqs] or [1]), 4)  # buckets: few distinct shapes
  z = pow2(max(len(seqs), 1), 4)
  stop_arr = np.full((z, w), -1, np.int32)
  lens = np.zeros(z, np.int32)
  for i, s in enumerate(seqs):
    stop_arr[i, w - len(s):] = s
    lens[i] = len(s)
  e = pow2(len(eos), 4)
  eos_arr = np.full(e, -1, np.int32)
  eos_arr[:len(eos)] = eos
  sp = sampling.SamplingParams(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
                               jnp.asarray(eos_arr), jnp.asarray(stop_arr), jnp.asarray(lens))
  filtered = (top_k > 0 or top_p < 1.0) and temperature > 0
  return sp, bool(filtered)


def assemble(groups: Sequence[GroupRequest], width: int) -> Rollout:
  """Stack complete groups into a prompt-major Rollout of width ``width``."""
  rows = [(g, s) for g, req in enumerate(groups) for s in req.samples]
  B = len(rows)
  tokens = np.zeros((B, width), np.int32)
  logprobs = np.zeros((B, width), np.float32)
  versions = np.full((B, width), -1, np.int32)
  lengths = np.zeros(B, np.int32)
  reasons = np.empty(B, dtype=object)
  index = np.zeros(B, np.int32)
  for b, (g, s) in enumerate(rows):
    t = len(s.tokens)
    tokens[b, :t], logprobs[b, :t], versions[b, :t] = s.tokens, s.logprobs, s.versions
    lengths[b], reasons[b], index[b] = t, s.finish_reason, g
  mask = np.arange(width)[None, :] < lengths[:, None]
  return Rollout(tokens, mask, logprobs, versions, lengths, reasons.astype(str), index,
                 [list(r.prompt) for r in groups], np.asarray([r.uid for r in groups], np.int64),
                 {"tokens": int(lengths.sum()), "groups": len(groups)},
                 [r.meta for r in groups], padded_routing([s for _, s in rows], width))


def padded_routing(samples: Sequence[Any], width: int) -> np.ndarray | None:
  """The expert records of ``samples`` (``Sample``s or multi-turn ``Trajectory``s: each's
  ``routing`` [t,Y,X] or None) as int32 [B,width,Y,X], -1 padded; None without any."""
  recorded = [s.routing for s in samples if s.routing is not None]
  if not recorded:
    return None
  out = np.full((len(samples), width, *recorded[0].shape[1:]), -1, np.int32)
  for b, s in enumerate(samples):
    if s.routing is not None:
      out[b, :len(s.routing)] = s.routing
  return out
