"""Hugging Face checkpoints in and out: ``config.json`` + safetensors (single or sharded).

``load_hf`` streams: it reads the safetensors files with plain reads (their headers, then
row ranges of one tensor at a time; nothing is memory-mapped), writes each tensor converted
into its place in a host array of rl_jax's stacked layout, and puts each finished parameter
on its devices once, so the host holds the parameters being placed plus one tensor's rows;
a quantised base (``quant`` override) is quantised layer by layer as it is read. ``save_hf``
writes tensor by tensor the same way and assembles its directory beside the target, renaming
it into place, so an interrupted export never leaves a half-written model where a finished
one was.

Axis letters: the legend of ``rl_jax/__init__.py``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
import re
import shutil
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from rl_jax.errors import ModelError
from rl_jax.models import lora, quant
from rl_jax.models import transformer as tx
from rl_jax.models.config import ModelConfig, from_hf_dict, to_hf_dict

__all__ = ["PEFT_LORA_ALPHA", "check_hf_adapter", "hf_adapter_state_dict", "hf_state_dict",
           "load_hf", "load_hf_adapter", "read_hf_config", "save_hf", "save_hf_adapter",
           "release_host_memory"]

# (our layer key, HF suffix, kind) kind: how to turn the HF tensor into ours.
_LAYER_MAP = (
    ("attn_norm", "input_layernorm.weight", "vector"),
    ("q", "self_attn.q_proj.weight", "in_heads_q"),
    ("k", "self_attn.k_proj.weight", "in_heads_kv"),
    ("v", "self_attn.v_proj.weight", "in_heads_kv"),
    ("o", "self_attn.o_proj.weight", "out_heads"),
    ("q_bias", "self_attn.q_proj.bias", "bias_q"),
    ("k_bias", "self_attn.k_proj.bias", "bias_kv"),
    ("v_bias", "self_attn.v_proj.bias", "bias_kv"),
    ("o_bias", "self_attn.o_proj.bias", "vector"),
    ("q_norm", "self_attn.q_norm.weight", "vector"),
    ("k_norm", "self_attn.k_norm.weight", "vector"),
    ("mlp_norm", "post_attention_layernorm.weight", "vector"),
    ("gate", "mlp.gate_proj.weight", "transpose"),
    ("up", "mlp.up_proj.weight", "transpose"),
    ("down", "mlp.down_proj.weight", "transpose"),
)
_GEMMA_NORMS = {"mlp_norm": "pre_feedforward_layernorm.weight",
                "post_attn_norm": "post_attention_layernorm.weight",
                "post_mlp_norm": "post_feedforward_layernorm.weight"}
_DENSE_MLP = ("gate", "up", "down")
# expert tensors: (our key, HF per-expert suffix); ours [E,D,F] / [E,F,D], HF [F,D] / [D,F]
_EXPERT_MAP = (("expert_gate", "gate_proj.weight"), ("expert_up", "up_proj.weight"),
               ("expert_down", "down_proj.weight"))


def _layer_map(cfg: ModelConfig) -> tuple[tuple[str, str, str], ...]:
  """(our key, HF suffix, kind) of the per-layer tensors in ``params["layers"]``."""
  rows = list(_LAYER_MAP)
  if cfg.architecture == "gemma3":
    rows = [(k, _GEMMA_NORMS.get(k, suffix), kind) for k, suffix, kind in rows]
    rows += [(k, _GEMMA_NORMS[k], "vector") for k in ("post_attn_norm", "post_mlp_norm")]
  if cfg.is_moe:
    rows = [r for r in rows if r[0] not in _DENSE_MLP]
  return tuple(rows)


def _to_ours(cfg: ModelConfig, kind: str, w: np.ndarray) -> np.ndarray:
  D, H = cfg.hidden_size, cfg.head_dim
  if kind == "vector":
    return w
  if kind == "transpose":
    return w.T
  if kind == "in_heads_q":  # [N·H, D] -> [D, N, H]
    return w.T.reshape(D, cfg.num_heads, H)
  if kind == "in_heads_kv":  # [K·H, D] -> [D, K, H]
    return w.T.reshape(D, cfg.num_kv_heads, H)
  if kind == "out_heads":  # [D, N·H] -> [N, H, D]
    return w.T.reshape(cfg.num_heads, H, D)
  if kind == "bias_q":
    return w.reshape(cfg.num_heads, H)
  if kind == "bias_kv":
    return w.reshape(cfg.num_kv_heads, H)
  raise AssertionError(kind)


def _to_hf(kind: str, w: np.ndarray) -> np.ndarray:
  if kind == "vector":
    return w
  if kind == "transpose":
    return w.T
  if kind in ("in_heads_q", "in_heads_kv"):  # [D, N, H] -> [N·H, D] (K for kv)
    return w.reshape(w.shape[0], -1).T
  if kind == "out_heads":  # [N, H, D] -> [D, N·H]
    return w.reshape(-1, w.shape[-1]).T
  if kind in ("bias_q", "bias_kv"):
    return w.reshape(-1)
  raise AssertionError(kind)


# safetensors dtype names <-> numpy dtypes (ml_dtypes for those numpy lacks)
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
              "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
              "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
# safetensors lays a file's tensors out by descending dtype (its enum order), then by name
_ST_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "F16", "BF16", "I32", "F32",
             "F64", "I64")
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
_CHUNK_BYTES = 64 << 20  # rows of a tensor read (or written) at a time


def _corrupt(fname: str, why: str) -> ModelError:
  return ModelError(f"safetensors file {fname} is corrupt or unreadable: {why}")


def _read_header(fname: str) -> dict[str, tuple[np.dtype, tuple[int, ...], int]]:
  """{tensor name: (dtype, shape, offset of its first byte in the file)} of a safetensors
  file, from its header alone (8-byte little-endian length, then that many bytes of JSON)."""
  if not os.path.exists(fname):
    raise ModelError(f"safetensors file {fname} is missing")
  try:
    size = os.path.getsize(fname)
    with open(fname, "rb") as f:
      head = f.read(8)
      n = int.from_bytes(head, "little") if len(head) == 8 else -1
      if n < 2 or n > min(_MAX_HEADER, size - 8):
        raise _corrupt(fname, f"header length {n} does not fit a file of {size} bytes")
      header = json.loads(f.read(n).decode("utf-8"))
  except OSError as e:
    raise _corrupt(fname, str(e)) from None
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise _corrupt(fname, f"header is not JSON ({e})") from None
  if not isinstance(header, dict):
    raise _corrupt(fname, "header is not a JSON object")
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    try:
      dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
      ok = all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end))
    except (TypeError, KeyError, ValueError):
      ok = False
    if not ok:
      raise _corrupt(fname, f"bad header entry for {name!r}: {info!r}")
    if dtype not in _ST_DTYPES:
      raise ModelError(f"tensor {name!r} in {fname} has dtype {dtype}, which rl_jax does not "
                       f"read (it reads {','.join(_ST_DTYPES)})")
    dt = np.dtype(_ST_DTYPES[dtype])
    if end - begin != int(np.prod(shape)) * dt.itemsize or 8 + n + end > size:
      raise _corrupt(fname, f"tensor {name!r} data_offsets {[begin, end]} do not match its "
                     f"shape {list(shape)} and {dtype} or lie outside the file")
    out[name] = (dt, shape, 8 + n + begin)
  return out


class _TensorIndex:
  """Name -> file for a single or sharded safetensors checkpoint. Tensors (or row ranges of
  them) are read with plain reads into fresh host arrays: nothing stays memory-mapped, so
  the pages of the files never count in the process's resident set."""

  def __init__(self, path: str):
    self._headers: dict[str, dict] = {}
    self.used: set[str] = set()  # names read so far
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
      try:
        with open(index) as f:
          weight_map = json.load(f)["weight_map"]
        self.files = {k: os.path.join(path, v) for k, v in weight_map.items()}
      except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ModelError(f"{index} is not a valid safetensors index ({e})") from None
    else:
      files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
      if not files:
        raise ModelError(f"no *.safetensors file in {path}")
      self.files: dict[str, str] = {}
      for fname in files:
        for name in self._header(os.path.join(path, fname)):
          if name in self.files:  # e.g. a stale shard beside a newer file: no silent winner
            raise ModelError(f"tensor {name!r} is in both {self.files[name]} and "
                             f"{os.path.join(path, fname)} (and no index names one)")
          self.files[name] = os.path.join(path, fname)

  def _header(self, fname: str) -> dict:
    if fname not in self._headers:
      self._headers[fname] = _read_header(fname)
    return self._headers[fname]

  def __contains__(self, name: str) -> bool:
    return name in self.files

  def info(self, name: str) -> tuple[np.dtype, tuple[int, ...], int, str]:
    """(dtype, shape, byte offset, file) of tensor ``name``."""
    if name not in self.files:
      raise ModelError(f"checkpoint lacks tensor {name!r}")
    fname = self.files[name]
    header = self._header(fname)
    if name not in header:
      raise ModelError(f"checkpoint lacks tensor {name!r}: the index names {fname}, which "
                       "does not hold it")
    return (*header[name], fname)

  def shape(self, name: str) -> tuple[int, ...]:
    return self.info(name)[1]

  def read(self, name: str, start: int = 0, stop: int | None = None,
           out: np.ndarray | None = None) -> np.ndarray:
    """Rows ``start:stop`` (axis 0) of tensor ``name`` in its file's dtype, read into ``out``
    (C-contiguous, that shape and dtype) or a new array; [stop-start, *shape[1:]]."""
    dtype, shape, offset, fname = self.info(name)
    self.used.add(name)
    rows = shape[0] if shape else 1
    stop = rows if stop is None else stop
    row_bytes = int(np.prod(shape[1:])) * dtype.itemsize
    if out is None:
      out = np.empty((stop - start, *shape[1:]), dtype)
    view = memoryview(out.reshape(-1).view(np.uint8))
    try:
      with open(fname, "rb", buffering=0) as f:
        f.seek(offset + start * row_bytes)
        done = 0
        while done < len(view):
          got = f.readinto(view[done:])
          if not got:
            raise _corrupt(fname, f"tensor {name!r} is cut short")
          done += got
    except OSError as e:
      raise ModelError(f"cannot read tensor {name!r} from {fname}: {e}") from None
    return out


def _convert(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """``x`` in ``dtype``, rounded as the loader always has: to float32 first (exact for every
  float checkpoint dtype up to float32), then once, to nearest even, to ``dtype``."""
  if x.dtype == dtype:
    return x
  f32 = x if x.dtype == np.float32 else x.astype(np.float32)
  return f32 if dtype == np.float32 else f32.astype(dtype)


def _hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], bool]:
  """(shape of the HF tensor, whether ours is its transpose) of one layer's tensor of ours,
  ``shape``, for ``_to_ours`` kind ``kind``: ours reshaped to the reversed HF shape is the HF
  tensor transposed (transposing kinds), or reshaped to the HF shape is the HF tensor."""
  size = int(np.prod(shape))
  if kind == "vector":
    return tuple(shape), False
  if kind in ("bias_q", "bias_kv"):  # [N, H] <- [N·H]
    return (size,), False
  if kind == "transpose":  # [A, B] <- [B, A]
    return tuple(shape[::-1]), True
  if kind in ("in_heads_q", "in_heads_kv"):  # [D, N, H] <- [N·H, D]
    return (size // shape[0], shape[0]), True
  if kind == "out_heads":  # [N, H, D] <- [D, N·H]
    return (shape[-1], size // shape[-1]), True
  raise AssertionError(kind)


def _check_shape(idx: _TensorIndex, name: str, want: tuple[int, ...]) -> None:
  got = tuple(idx.shape(name))
  if got != tuple(want):
    raise ModelError(f"tensor {name!r} has shape {got}, config.json implies {tuple(want)}")


def _fill(idx: _TensorIndex, name: str, dst: np.ndarray, kind: str) -> None:
  """Writes HF tensor ``name`` into ``dst`` (one C-contiguous tensor of ours, in its final
  dtype; ``_to_ours`` of the HF tensor), ``_CHUNK_BYTES`` of the file's rows at a time."""
  hf_shape, transposed = _hf_shape(kind, dst.shape)
  _check_shape(idx, name, hf_shape)
  if not dst.size:
    return
  src_dtype = idx.info(name)[0]
  rows = hf_shape[0]
  step = max(1, _CHUNK_BYTES // max(1, (dst.size // rows) * max(src_dtype.itemsize, 4)))
  if transposed:
    view = dst.reshape(hf_shape[::-1])  # = hf.T
    for r in range(0, rows, step):
      view[:, r:r + step] = _convert(idx.read(name, r, min(r + step, rows)), dst.dtype).T
  else:
    view = dst.reshape(hf_shape)
    for r in range(0, rows, step):
      stop = min(r + step, rows)
      if src_dtype == dst.dtype:  # straight into place
        idx.read(name, r, stop, out=view[r:stop])
      else:
        view[r:stop] = _convert(idx.read(name, r, stop), dst.dtype)


_host_empty = quant._host_empty  # pylint: disable=protected-access


def read_hf_config(path: str, **overrides) -> ModelConfig:
  """ModelConfig from ``path/config.json`` (overrides: dtype, param_dtype, remat, ...)."""
  if not os.path.isdir(path):
    raise ModelError(f"model directory {path} does not exist")
  cfg_file = os.path.join(path, "config.json")
  if not os.path.exists(cfg_file):
    raise ModelError(f"{cfg_file} is missing")
  try:
    with open(cfg_file) as f:
      hf = json.load(f)
  except json.JSONDecodeError as e:
    raise ModelError(f"{cfg_file} is not valid JSON: {e}") from None
  return from_hf_dict(hf, **overrides)


def load_hf(path: str, dtype=jnp.float32, shardings: Any = None, compute_dtype=None,
            **overrides):
  """Load a Llama / Qwen2 / Qwen3 / Qwen3-MoE / Gemma 3 (text) HF directory.

  Streams the checkpoint: each parameter of ours (per-layer tensors stacked over layers,
  [L, ...]) is filled in a host array of its final dtype, HF tensor by HF tensor (row chunks
  read from the files, nothing memory-mapped), then placed on its devices once and the host
  array dropped before the next parameter is read (the CPU backend adopts it without a
  copy). The peak is the parameters plus about one parameter on the host.

  With ``quant`` in the overrides (``"int8"`` / ``"int4"``, and ``quant_block``) the
  projections ``quant.targets`` are quantised layer by layer as they are read
  (``quant.quantize_layers``): the float weights never exist whole, and the result is what
  ``quant.quantize_base`` makes of the float load.

  Args:
    path: directory with config.json and model.safetensors (or sharded files + index).
    dtype: parameter storage dtype (float32 or bfloat16).
    compute_dtype: activation/matmul dtype (default: same as ``dtype``); float32 master
      weights with bfloat16 compute is ``dtype=jnp.float32, compute_dtype="bfloat16"``.
    shardings: optional pytree of NamedShardings (``transformer.param_shardings`` of the
      returned config: a quantised weight's may be a ``QArray`` of two, or W's alone);
      each parameter is placed straight onto its shards.
    overrides: ModelConfig fields to override (e.g. ``dtype="bfloat16", remat="full"``).
  Returns:
    (cfg, params). On CPU the arrays keep the loader's host buffers (no copy); a program that
    donates them cannot reuse those, so pass them through ``own_buffers`` first (the trainer
    does, for parameters it trains whole).
  """
  dtype = jnp.dtype(dtype)
  compute = jnp.dtype(compute_dtype or dtype).name
  cfg = read_hf_config(path, param_dtype=dtype.name, dtype=compute, **overrides)
  idx = _TensorIndex(path)
  expected = tx.param_shapes(cfg.replace(quant=""))
  sh = shardings or {}

  def load(names, shape, kind, where):
    """HF tensors ``names`` (nested lists: the leading axes) stacked, [*lead, *shape]."""
    return _place(_stack(idx, names, tuple(shape), kind, dtype), where)

  params: dict[str, Any] = {}
  params["embed"] = load("model.embed_tokens.weight", expected["embed"], "vector",
                         sh.get("embed"))
  params["final_norm"] = load("model.norm.weight", expected["final_norm"], "vector",
                              sh.get("final_norm"))
  if not cfg.tie_word_embeddings:
    if "lm_head.weight" not in idx:
      raise ModelError("checkpoint lacks 'lm_head.weight' but config.json says the "
                       "embeddings are untied")
    params["lm_head"] = load("lm_head.weight", expected["lm_head"], "transpose",
                             sh.get("lm_head"))
  layers = {}
  for key, suffix, kind in _layer_map(cfg):
    if key not in expected["layers"]:
      continue
    names = [f"model.layers.{i}.{suffix}" for i in range(cfg.num_layers)]
    shape, where = expected["layers"][key][1:], sh.get("layers", {}).get(key)
    if key in quant.targets(cfg):
      layers[key] = quant.quantize_layers(
          cfg, key, (_stack(idx, name, shape, kind, dtype) for name in names), where)
    else:
      layers[key] = load(names, shape, kind, where)
  params["layers"] = layers
  if cfg.is_moe:
    _load_mlp_stacks(cfg, idx, expected, params, load, dtype, sh)
  release_host_memory()  # the read buffers of the tensors, freed above
  _check_layers_read(idx, cfg, path)
  return cfg, params


_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


def _check_layers_read(idx: _TensorIndex, cfg: ModelConfig, path: str) -> None:
  """Raises when a tensor of one of the model's layers was never read: the layers are then
  another architecture's than config.json's ``model_type`` says (Qwen3's q_norm under
  ``"llama"``, say), and the model would run without them. Tensors outside the layers
  (a vision tower, extra heads) and RoPE's cached ``inv_freq`` are not weights of the model
  and stay unread."""
  unread = sorted(
      name for name in idx.files
      if name not in idx.used and not name.endswith("rotary_emb.inv_freq")
      and (m := _LAYER_TENSOR.match(name)) and int(m.group(1)) < cfg.num_layers)
  if unread:
    with open(os.path.join(path, "config.json")) as f:
      model_type = json.load(f).get("model_type")
    raise ModelError(
        f"{path}: {len(unread)} layer tensor(s) that a {model_type!r} model (config.json's "
        f"model_type) has no place for, e.g. {unread[0]!r}: the weights are another "
        "architecture's; set model_type to theirs")


def _stack(idx: _TensorIndex, names, shape: tuple[int, ...], kind: str, dtype) -> np.ndarray:
  """Host array [*lead, *shape] in ``dtype`` of the HF tensors ``names`` (a name, or nested
  lists of names whose nesting gives the leading axes ``lead``), each ``_to_ours`` ``kind``."""
  flat = np.asarray(names, dtype=object)
  host = _host_empty((*flat.shape, *shape), dtype)
  rows = host.reshape(-1, *shape)  # a view: host is C-contiguous
  for i, name in enumerate(flat.reshape(-1)):
    _fill(idx, name, rows[i], kind)
  return host


def _place(host: np.ndarray, where) -> jax.Array:
  """``host`` on its sharding ``where`` (None: the default device)."""
  return jax.device_put(host, where) if where is not None else jax.device_put(host)


def own_buffers(params: dict) -> dict:
  """``params`` (nested dicts) with each array on CPU devices replaced, in place and one at a
  time, by a copy in a buffer XLA allocated. On CPU ``load_hf``'s arrays adopt their aligned
  host buffers without a copy (``quant._host_empty``), and XLA cannot reuse such a buffer
  for a donated argument: the first update of loaded parameters would hold them twice (a
  Qwen3-0.6B-shaped run peaked 2.2 GiB higher). One leaf is held twice at a time here; other
  backends copy at ``device_put`` and are left as they are."""
  for key, value in params.items():
    if isinstance(value, dict):
      own_buffers(value)
    else:
      params[key] = jax.tree.map(
          lambda x: jnp.copy(x) if all(d.platform == "cpu" for d in x.devices()) else x,
          value)
  return params


def _load_mlp_stacks(cfg, idx, expected, params, load, dtype, sh):
  """MoE models: ``params["moe"]`` over the Y MoE layers (router [Y,D,E], expert gate / up
  [Y,E,D,F], down [Y,E,F,D]), ``params["mlp"]`` over the dense others."""
  if cfg.dense_layers:
    mlp = {}
    for key, suffix, kind in _LAYER_MAP:
      if key in _DENSE_MLP:
        mlp[key] = load([f"model.layers.{i}.{suffix}" for i in cfg.dense_layers],
                        expected["mlp"][key][1:], kind, sh.get("mlp", {}).get(key))
    params["mlp"] = mlp
  where, shapes = sh.get("moe", {}), expected["moe"]
  pre = [f"model.layers.{i}.mlp." for i in cfg.moe_layers]
  moe = {"router": load([p + "gate.weight" for p in pre], shapes["router"][1:], "transpose",
                        where.get("router"))}
  if pre[0] + "experts.gate_up_proj" in idx:  # fused [E,2F,D] and [E,D,F] per layer
    gate_up, down = _fused_experts(idx, pre, shapes, dtype)
    moe["expert_gate"] = _place(gate_up[0], where.get("expert_gate"))
    moe["expert_up"] = _place(gate_up[1], where.get("expert_up"))
    del gate_up
    moe["expert_down"] = _place(down, where.get("expert_down"))
  else:  # per-expert [F,D] (gate, up) and [D,F] (down)
    for key, suffix in _EXPERT_MAP:
      names = [[f"{p}experts.{e}.{suffix}" for e in range(cfg.num_experts)] for p in pre]
      moe[key] = load(names, shapes[key][2:], "transpose", where.get(key))
  params["moe"] = {k: moe[k] for k in shapes}


def _fused_experts(idx, pre, shapes, dtype) -> tuple[list[np.ndarray], np.ndarray]:
  """([gate, up] [Y,E,D,F], down [Y,E,F,D]) host stacks from the fused per-layer tensors
  ``experts.gate_up_proj`` [E,2F,D] (gate rows first) and ``experts.down_proj`` [E,D,F]
  (prefixes ``pre``), read a few experts at a time."""
  Y, E, D, F = shapes["expert_gate"]
  gate_up = [_host_empty((Y, E, D, F), dtype), _host_empty((Y, E, D, F), dtype)]
  down = _host_empty((Y, E, F, D), dtype)
  step = max(1, _CHUNK_BYTES // (2 * F * D * 4))
  for j, p in enumerate(pre):
    _check_shape(idx, p + "experts.gate_up_proj", (E, 2 * F, D))
    _check_shape(idx, p + "experts.down_proj", (E, D, F))
    for e in range(0, E, step):
      chunk = _convert(idx.read(p + "experts.gate_up_proj", e, min(e + step, E)), dtype)
      gate_up[0][j, e:e + step] = np.swapaxes(chunk[:, :F], 1, 2)
      gate_up[1][j, e:e + step] = np.swapaxes(chunk[:, F:], 1, 2)
      chunk = _convert(idx.read(p + "experts.down_proj", e, min(e + step, E)), dtype)
      down[j, e:e + step] = np.swapaxes(chunk, 1, 2)
  return gate_up, down


@functools.cache
def _glibc_malloc_trim():
  """glibc's ``malloc_trim``, or None where there is no glibc; looked up once
  (``ctypes.util.find_library`` runs ``ldconfig`` in a subprocess, and the learner calls
  ``release_host_memory`` before every update of a large policy)."""
  try:
    return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
  except (OSError, AttributeError, TypeError):
    return None


def release_host_memory() -> bool:
  """Hands the C heap's free pages back to the OS (glibc ``malloc_trim``); False where
  there is no glibc. The loader's host copies of the tensors (several MB each) are freed
  into the heap, which glibc otherwise keeps: a few hundred MB of a 0.6B model's load stay
  in the process's resident set for the whole run."""
  trim = _glibc_malloc_trim()
  if trim is None:
    return False
  trim(0)
  return True


def hf_state_dict(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
  """HF tensor names -> host arrays (float32 or the parameter dtype). Adapters
  (``cfg.lora_rank``) are merged into their weights (``lora.merge``)."""
  host = jax.device_get(lora.merge(cfg, params))
  out = {"model.embed_tokens.weight": np.asarray(host["embed"]),
         "model.norm.weight": np.asarray(host["final_norm"])}
  if not cfg.tie_word_embeddings:
    out["lm_head.weight"] = np.asarray(host["lm_head"]).T
  for key, suffix, kind in _layer_map(cfg):
    if key not in host["layers"]:
      continue
    stacked = np.asarray(host["layers"][key])
    for i in range(cfg.num_layers):
      out[f"model.layers.{i}.{suffix}"] = _to_hf(kind, stacked[i])
  if cfg.is_moe:
    out.update(_moe_state_dict(cfg, host))
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _moe_state_dict(cfg: ModelConfig, host) -> dict[str, np.ndarray]:
  """HF tensors of the MLPs of a MoE model (per-expert tensors, as transformers saves them)."""
  out = {}
  for j, i in enumerate(cfg.dense_layers):
    for key, suffix, kind in _LAYER_MAP:
      if key in _DENSE_MLP:
        out[f"model.layers.{i}.{suffix}"] = _to_hf(kind, np.asarray(host["mlp"][key][j]))
  for j, i in enumerate(cfg.moe_layers):
    pre = f"model.layers.{i}.mlp."
    out[pre + "gate.weight"] = np.asarray(host["moe"]["router"][j]).T
    for key, suffix in _EXPERT_MAP:
      stacked = np.asarray(host["moe"][key][j])
      for e in range(cfg.num_experts):
        out[f"{pre}experts.{e}.{suffix}"] = stacked[e].T
  return out


# LoRA target -> PEFT module path under model.layers.{i}
_PEFT_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                 "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                 "down": "mlp.down_proj"}


def hf_adapter_state_dict(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
  """PEFT tensor names -> host arrays of the adapters in ``params``.

  PEFT stores ``lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r] (delta W_hf =
  (α/r)·B_hf·A_hf); ours are A [<in>, r] and B [r, <out>] per layer, with the head axes in
  the order of the HF projections (``_to_hf``), so A_hf = A.reshape(in, r).T and
  B_hf = B.reshape(r, out).T.
  """
  _, adapters = lora.split(params)
  host = jax.device_get(adapters)
  out = {}
  for t, ab in host.items():
    a, b = np.asarray(ab["a"]), np.asarray(ab["b"])
    for i in range(cfg.num_layers):
      pre = f"base_model.model.model.layers.{i}.{_PEFT_MODULES[t]}."
      out[pre + "lora_A.weight"] = a[i].reshape(-1, cfg.lora_rank).T
      out[pre + "lora_B.weight"] = b[i].reshape(cfg.lora_rank, -1).T
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def adapter_config(cfg: ModelConfig, base_model_name_or_path: str | None) -> dict[str, Any]:
  """PEFT's ``adapter_config.json`` of the adapters of ``cfg``."""
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank,
          "lora_alpha": cfg.lora_alpha, "lora_dropout": 0.0, "bias": "none",
          "target_modules": sorted(_PEFT_MODULES[t].split(".")[1] for t in cfg.lora_targets),
          "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
          "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
          "base_model_name_or_path": base_model_name_or_path}


def save_hf_adapter(cfg: ModelConfig, params, path: str,
                    base_model_name_or_path: str | None = None) -> str:
  """Write the adapters of ``params`` to ``path`` in PEFT's format (``adapter_config.json`` +
  ``adapter_model.safetensors``), atomically like ``save_hf``; ``peft.PeftModel.from_pretrained``
  loads it onto the transformers model of the base."""
  if not cfg.lora_rank:
    raise ModelError("save_hf_adapter: the model has no adapters (lora_rank=0)")
  tensors = {k: v.astype(np.float32) if v.dtype not in (np.float32, np.float16) else v
             for k, v in hf_adapter_state_dict(cfg, params).items()}
  with _atomic_dir(path) as tmp:
    with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
      json.dump(adapter_config(cfg, base_model_name_or_path), f, indent=2, sort_keys=True)
    save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
  return path


# PEFT module name -> LoRA target ("q_proj" -> "q")
_PEFT_TARGETS = {m.split(".")[1]: t for t, m in _PEFT_MODULES.items()}
_PEFT_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                       r"\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# what PEFT's LoraConfig takes for an adapter_config.json without lora_alpha
PEFT_LORA_ALPHA = 8
# adapter_config.json fields rl_jax's plain LoRA cannot represent -> their neutral values
_PEFT_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False,
                     "bias": "none", "lora_bias": False, "rank_pattern": {}, "alpha_pattern": {},
                     "modules_to_save": None, "layers_to_transform": None,
                     "trainable_token_indices": None, "layer_replication": None}


def _read_adapter(path: str) -> tuple[dict[str, Any], str]:
  """(adapter_config.json, path of adapter_model.safetensors) of a PEFT directory."""
  if not os.path.isdir(path):
    raise ModelError(f"adapter directory {path} does not exist")
  cfg_file = os.path.join(path, "adapter_config.json")
  tensors = os.path.join(path, "adapter_model.safetensors")
  if not os.path.exists(cfg_file):
    raise ModelError(f"{cfg_file} is missing")
  if not os.path.exists(tensors):
    raise ModelError(f"{tensors} is missing (PEFT's safetensors format; adapter_model.bin is "
                     "not read)")
  try:
    with open(cfg_file) as f:
      config = json.load(f)
  except json.JSONDecodeError as e:
    raise ModelError(f"{cfg_file} is not valid JSON: {e}") from None
  if not isinstance(config, dict):
    raise ModelError(f"{cfg_file} is not a JSON object")
  return config, tensors


def _open_adapter(fname: str):
  try:
    return safe_open(fname, framework="flax")
  except Exception as e:  # safetensors raises its own error types for corrupt headers
    raise ModelError(f"safetensors file {fname} is corrupt or unreadable: "
                     f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _peft_targets(config: dict[str, Any], names: list[str]) -> tuple[str, ...]:
  """LoRA targets (``LORA_TARGETS`` order) of ``target_modules`` (a list, a name,
  ``"all-linear"``, or a regex: then the modules of the tensors ``names``)."""
  modules = config.get("target_modules")
  if isinstance(modules, str):
    if modules == "all-linear":
      modules = list(_PEFT_TARGETS)
    elif modules in _PEFT_TARGETS:
      modules = [modules]
    else:  # a regular expression over module paths: what the tensors adapt
      modules = sorted({m.group(2) for m in map(_PEFT_KEY.match, names) if m})
  if not isinstance(modules, (list, tuple)) or not modules:
    raise ModelError(f"adapter_config.json target_modules={modules!r} names no module")
  bad = sorted(str(m) for m in modules if m not in _PEFT_TARGETS)
  if bad:
    raise ModelError(f"adapter_config.json target_modules names {bad[0]!r}, which rl_jax "
                     f"cannot adapt (it adapts {','.join(_PEFT_TARGETS)})")
  return tuple(t for t in lora.LORA_TARGETS if _PEFT_MODULES[t].split(".")[1] in modules)


def _same_base(name: str, hf_path: str) -> bool:
  """Whether ``base_model_name_or_path`` ``name`` (a hub id or a path) names the checkpoint
  ``hf_path``: the same directory, or the same last path component (``Qwen/Qwen3-0.6B`` and
  ``/models/Qwen3-0.6B``, or a hub cache's ``models--Qwen--Qwen3-0.6B/snapshots/<hash>``)."""
  if os.path.exists(name) and os.path.realpath(name) == os.path.realpath(hf_path):
    return True
  tail = name.rstrip("/").split("/")[-1].lower()
  real = os.path.realpath(hf_path).rstrip("/")
  return (tail == os.path.basename(hf_path.rstrip("/")).lower()
          or tail == os.path.basename(real).lower()
          or "models--" + name.strip("/").replace("/", "--").lower() in real.lower())


def check_hf_adapter(cfg: ModelConfig, path: str, hf_path: str | None = None) -> None:
  """Raise a one-line ``ModelError`` naming the field unless the PEFT adapter at ``path``
  (``adapter_config.json`` + ``adapter_model.safetensors``) fits ``cfg``: a plain LoRA
  (``peft_type`` LORA, no DoRA / rsLoRA / per-module ranks / bias / saved modules), ``r`` =
  ``cfg.lora_rank``, ``lora_alpha`` = ``cfg.lora_alpha``, ``target_modules`` =
  ``cfg.lora_targets``, one A and one B per target and layer with the shapes of the base's
  weights, and ``base_model_name_or_path`` (if set) naming ``hf_path`` (``_same_base``).
  Reads the safetensors header only."""
  config, fname = _read_adapter(path)
  if config.get("peft_type", "LORA") != "LORA":
    raise ModelError(f"adapter_config.json peft_type={config.get('peft_type')!r}: only LORA "
                     "adapters load")
  for key, neutral in _PEFT_UNSUPPORTED.items():
    if config.get(key, neutral) not in (neutral, None, {}, [], False):
      raise ModelError(f"adapter_config.json {key}={config[key]!r} is not supported (rl_jax "
                       f"adapters are plain LoRA: {key}={neutral!r})")
  r = config.get("r")
  if not isinstance(r, int) or isinstance(r, bool) or r < 1:
    raise ModelError(f"adapter_config.json r={r!r} must be a positive integer")
  if r != cfg.lora_rank:
    raise ModelError(f"adapter_config.json r={r!r} but model.lora.rank={cfg.lora_rank}; set "
                     f"model.lora.rank={r}")
  alpha = config.get("lora_alpha", PEFT_LORA_ALPHA)
  if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
    raise ModelError(f"adapter_config.json lora_alpha={alpha!r} must be a number")
  if not np.isclose(alpha, cfg.lora_alpha):
    raise ModelError(f"adapter_config.json lora_alpha={alpha!r} but model.lora.alpha="
                     f"{cfg.lora_alpha:g}; set model.lora.alpha={alpha}")
  handle = _open_adapter(fname)
  names = sorted(handle.keys())
  targets = _peft_targets(config, names)
  if targets != cfg.lora_targets:
    raise ModelError(f"adapter_config.json target_modules={config.get('target_modules')!r} "
                     f"(targets {','.join(targets)}) but model.lora.targets="
                     f"{','.join(cfg.lora_targets)}; set model.lora.targets={','.join(targets)}")
  shapes = lora.adapter_shapes(cfg)
  want = {}
  for t in targets:
    sa, sb = shapes[t]["a"], shapes[t]["b"]
    for i in range(cfg.num_layers):
      pre = f"base_model.model.model.layers.{i}.{_PEFT_MODULES[t]}."
      want[pre + "lora_A"] = (cfg.lora_rank, int(np.prod(sa[1:-1])))
      want[pre + "lora_B"] = (int(np.prod(sb[2:])), cfg.lora_rank)
  seen = set()
  for name in names:
    m = _PEFT_KEY.match(name)
    if not m or m.group(2) not in _PEFT_TARGETS:
      raise ModelError(f"adapter_model.safetensors holds {name!r}, which is not the LoRA A or B "
                       "of a decoder projection")
    key = name[:m.start(3) - len("lora_")] + "lora_" + m.group(3)
    if int(m.group(1)) >= cfg.num_layers:
      raise ModelError(f"adapter_model.safetensors tensor {name!r} is for layer {m.group(1)} "
                       f"but the base has {cfg.num_layers} layers (an adapter for another base)")
    if key not in want:
      raise ModelError(f"adapter_model.safetensors tensor {name!r} adapts a module outside "
                       f"target_modules")
    shape = tuple(handle.get_slice(name).get_shape())
    if shape != want[key]:
      raise ModelError(f"adapter_model.safetensors tensor {name!r} has shape {shape} but the "
                       f"base's weights and r={cfg.lora_rank} imply {want[key]} (an adapter for "
                       "another base)")
    seen.add(key)
  missing = sorted(set(want) - seen)
  if missing:
    raise ModelError(f"adapter_model.safetensors lacks {missing[0]}.weight")
  name = config.get("base_model_name_or_path")
  if name and not hf_path:
    raise ModelError(f"adapter_config.json base_model_name_or_path={name!r} but model.hf_path "
                     "is unset (a random base); set model.hf_path to that checkpoint")
  if name and not _same_base(str(name), hf_path):
    raise ModelError(f"adapter_config.json base_model_name_or_path={name!r} does not name "
                     f"model.hf_path={hf_path!r} (an adapter for another base; if it is the same "
                     "weights, set base_model_name_or_path to null)")


def load_hf_adapter(cfg: ModelConfig, path: str, hf_path: str | None = None,
                    dtype=None) -> dict[str, dict[str, np.ndarray]]:
  """The PEFT adapter at ``path`` (``check_hf_adapter`` first) as rl_jax adapters: host
  arrays in ``dtype`` (default ``lora.adapter_dtype(cfg)``), target -> {"a": [L,<in>,r],
  "b": [L,r,<out>]}, the inverse of ``hf_adapter_state_dict``: A = A_hf.T.reshape(<in>, r),
  B = B_hf.T.reshape(r, <out>)."""
  check_hf_adapter(cfg, path, hf_path)
  _, fname = _read_adapter(path)
  handle = _open_adapter(fname)
  by_key = {}
  for name in handle.keys():
    m = _PEFT_KEY.match(name)
    by_key[(_PEFT_TARGETS[m.group(2)], int(m.group(1)), m.group(3))] = name
  dtype = jnp.dtype(dtype or lora.adapter_dtype(cfg))
  get = lambda name: np.asarray(jax.device_get(handle.get_tensor(name).astype(jnp.float32)))
  out = {}
  for t, shape in lora.adapter_shapes(cfg).items():
    a = [get(by_key[(t, i, "A")]).T.reshape(shape["a"][1:]) for i in range(cfg.num_layers)]
    b = [get(by_key[(t, i, "B")]).T.reshape(shape["b"][1:]) for i in range(cfg.num_layers)]
    out[t] = {"a": np.stack(a).astype(dtype), "b": np.stack(b).astype(dtype)}
  return out


def _umask_modes(root: str) -> None:
  """Gives ``root`` and everything under it the modes a new directory or file gets from the
  process's umask (``mkdtemp`` makes its directory 0700, and some writers their files 0600),
  so another user who may read the workdir may read an export too."""
  mask = os.umask(0)
  os.umask(mask)
  os.chmod(root, 0o777 & ~mask)
  for parent, dirs, files in os.walk(root):
    for name in dirs:
      os.chmod(os.path.join(parent, name), 0o777 & ~mask)
    for name in files:
      os.chmod(os.path.join(parent, name), 0o666 & ~mask)


class _atomic_dir:  # pylint: disable=invalid-name
  """``with _atomic_dir(path) as tmp``: fill ``tmp``; it replaces ``path`` on success (the
  directory a symlink ``path`` points to: the link stays)."""

  def __init__(self, path: str):
    self.path = os.path.realpath(path) if os.path.islink(path) else path
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    self.tmp = tempfile.mkdtemp(prefix=".tmp_hf_", dir=parent)

  def __enter__(self) -> str:
    return self.tmp

  def __exit__(self, kind, value, tb):
    if kind is not None:
      shutil.rmtree(self.tmp, ignore_errors=True)
      return False
    _umask_modes(self.tmp)
    path = self.path
    if os.path.exists(path):
      old = path + ".old"
      shutil.rmtree(old, ignore_errors=True)
      os.replace(path, old)
      os.replace(self.tmp, path)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.replace(self.tmp, path)
    return False


def _export_tensors(cfg: ModelConfig, params) -> list[tuple[str, tuple[int, ...], Any, Any]]:
  """The HF tensors of ``params`` (adapters merged, a quantised base dequantised), in
  ``hf_state_dict``'s order, each as (name, shape, dtype, get): ``get()`` returns the tensor as
  a host array in the parameter dtype (often a transposed view), fetching only its layer (a
  view, uncopied, of an array on one CPU device; a merged or dequantised weight is computed
  for that layer alone, ``lora.layer_merges``)."""
  lazy = lora.layer_merges(cfg, params)  # merged / dequantised a layer at a time, when read
  base = lora.strip(params)
  merged = {**base, "layers": {k: v for k, v in base["layers"].items() if k not in lazy}}
  host = _HostLayers()
  out = [("model.embed_tokens.weight", tuple(merged["embed"].shape), merged["embed"].dtype,
          lambda: host.get(merged["embed"])),
         ("model.norm.weight", tuple(merged["final_norm"].shape), merged["final_norm"].dtype,
          lambda: host.get(merged["final_norm"]))]
  if not cfg.tie_word_embeddings:
    out.append(("lm_head.weight", tuple(merged["lm_head"].shape[::-1]),
                merged["lm_head"].dtype, lambda: host.get(merged["lm_head"]).T))

  def layer(arr, i, kind, expert=None):
    shape = arr.shape[1:] if expert is None else arr.shape[2:]
    hf_shape = _hf_shape(kind, shape)[0]
    get = (lambda: _to_hf(kind, host.get(arr, i))) if expert is None else (
        lambda: _to_hf(kind, host.get(arr, i)[expert]))
    return hf_shape, arr.dtype, get

  def lazy_layer(key, i, kind):
    shape, dtype, get_layer = lazy[key]
    return _hf_shape(kind, shape[1:])[0], dtype, lambda: _to_hf(kind, get_layer(i))

  for key, suffix, kind in _layer_map(cfg):
    if key in lazy:
      for i in range(cfg.num_layers):
        out.append((f"model.layers.{i}.{suffix}", *lazy_layer(key, i, kind)))
    elif key in merged["layers"]:
      for i in range(cfg.num_layers):
        out.append((f"model.layers.{i}.{suffix}", *layer(merged["layers"][key], i, kind)))
  if cfg.is_moe:
    for j, i in enumerate(cfg.dense_layers):
      for key, suffix, kind in _LAYER_MAP:
        if key in _DENSE_MLP:
          out.append((f"model.layers.{i}.{suffix}", *layer(merged["mlp"][key], j, kind)))
    for j, i in enumerate(cfg.moe_layers):
      pre = f"model.layers.{i}.mlp."
      out.append((pre + "gate.weight", *layer(merged["moe"]["router"], j, "transpose")))
      for key, suffix in _EXPERT_MAP:
        for e in range(cfg.num_experts):
          out.append((f"{pre}experts.{e}.{suffix}",
                      *layer(merged["moe"][key], j, "transpose", expert=e)))
  return out


class _HostLayers:
  """Host views of device arrays, one layer at a time: an array on a single CPU device is
  read in place (``np.asarray`` does not copy it); any other is fetched one layer per
  ``get`` (the last layer fetched kept, for the experts of a MoE layer)."""

  def __init__(self):
    self._last: tuple[Any, Any, np.ndarray] | None = None

  def get(self, arr, i: int | None = None) -> np.ndarray:
    devices = getattr(arr, "sharding", None) and arr.sharding.device_set
    if devices and len(devices) == 1 and next(iter(devices)).platform == "cpu":
      whole = np.asarray(arr)
      return whole if i is None else whole[i]
    if i is None:
      return np.asarray(jax.device_get(arr))
    if self._last is None or self._last[0] is not arr or self._last[1] != i:
      self._last = (arr, i, np.asarray(jax.device_get(arr[i])))
    return self._last[2]


def _export_dtype(dtype) -> np.dtype:
  """The dtype ``save_hf`` writes a ``dtype`` tensor in: float16 and float32 as they are,
  any other as float32 (safetensors' numpy writer has no bfloat16)."""
  dtype = np.dtype(dtype)
  return dtype if dtype in (np.float32, np.float16) else np.dtype(np.float32)


def _write_safetensors(fname: str, tensors: list[tuple[str, tuple[int, ...], np.dtype, Any]],
                       metadata: dict[str, str] | None = None) -> None:
  """A safetensors file of ``tensors`` ((name, shape, dtype, get): ``get()`` gives the
  tensor, cast to ``dtype`` here), written tensor by tensor, ``_CHUNK_BYTES`` of rows at a
  time: byte for byte the file ``safetensors.numpy.save_file`` writes of the same tensors
  (tensors laid out by descending dtype, then name; a compact JSON header padded with spaces
  to a multiple of 8 bytes)."""
  order = sorted(tensors, key=lambda t: (-_ST_ORDER.index(_ST_NAMES[np.dtype(t[2])]), t[0]))
  header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
  offset = 0
  for name, shape, dtype, _ in order:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    header[name] = {"dtype": _ST_NAMES[np.dtype(dtype)], "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
  head += b" " * (-len(head) % 8)
  with open(fname, "wb") as f:
    f.write(len(head).to_bytes(8, "little"))
    f.write(head)
    for name, shape, dtype, get in order:
      arr = get()
      if tuple(arr.shape) != tuple(shape):
        raise AssertionError(f"{name}: {arr.shape} != {shape}")
      rows = max(1, _CHUNK_BYTES // max(1, int(np.prod(shape[1:])) * 4))
      for r in range(0, shape[0] if shape else 1, rows):
        part = np.ascontiguousarray(arr[r:r + rows] if shape else arr, dtype=dtype)
        f.write(memoryview(part.reshape(-1).view(np.uint8)))


def save_hf(cfg: ModelConfig, params, path: str, max_shard_bytes: int = 4 << 30) -> str:
  """Write ``path`` (config.json + safetensors, sharded above ``max_shard_bytes``) atomically.

  The directory is assembled beside ``path`` and renamed into place; an existing ``path`` is
  replaced only once the new one is complete. bfloat16 weights are written as float32
  (numpy has no native bfloat16 in safetensors' numpy writer). Tensor by tensor: besides
  one layer's merged adapters (``lora.layer_merges``) the host holds one row chunk at a time
  (arrays on other devices than one CPU: one layer of one parameter).
  """
  tensors = [(name, shape, _export_dtype(dtype), get)
             for name, shape, dtype, get in _export_tensors(cfg, params)]
  with _atomic_dir(path) as tmp:
    hf_cfg = to_hf_dict(cfg)
    hf_cfg["torch_dtype"] = str(tensors[0][2])
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf_cfg, f, indent=2, sort_keys=True)
    shards, cur, size = [], [], 0
    for t in tensors:
      nbytes = int(np.prod(t[1])) * t[2].itemsize
      if cur and size + nbytes > max_shard_bytes:
        shards.append(cur)
        cur, size = [], 0
      cur.append(t)
      size += nbytes
    shards.append(cur)
    if len(shards) == 1:
      _write_safetensors(os.path.join(tmp, "model.safetensors"), shards[0], {"format": "pt"})
    else:
      weight_map = {}
      for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(os.path.join(tmp, fname), shard, {"format": "pt"})
        weight_map.update({t[0]: fname for t in shard})
      total = sum(int(np.prod(t[1])) * t[2].itemsize for t in tensors)
      with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return path
