"""Hugging Face checkpoints in and out: ``config.json`` + safetensors (single or sharded).

Tensors are read lazily with ``safe_open`` (memory-mapped, no pickle) and converted one at
a time into rl_jax's stacked layout, so peak host memory is about one copy of the weights.
``save_hf`` writes to a temporary directory and renames it into place, so an interrupted
export never leaves a half-written model where a finished one was.

Axis letters: the legend of ``rl_jax/__init__.py``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from rl_jax.errors import ModelError
from rl_jax.models import lora
from rl_jax.models import transformer as tx
from rl_jax.models.config import ModelConfig, from_hf_dict, to_hf_dict

__all__ = ["hf_adapter_state_dict", "hf_state_dict", "load_hf", "read_hf_config", "save_hf",
           "save_hf_adapter", "release_host_memory"]

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


def _load_experts(idx: "_TensorIndex", cfg: ModelConfig, layer: int) -> dict[str, np.ndarray]:
  """One MoE layer's router [D,E] and experts ([E,D,F] gate/up, [E,F,D] down), from
  per-expert tensors or the fused ``experts.gate_up_proj`` / ``experts.down_proj``."""
  pre = f"model.layers.{layer}.mlp."
  out = {"router": idx.get(pre + "gate.weight").T}
  if pre + "experts.gate_up_proj" in idx:  # fused [E,2F,D] and [E,D,F]
    gate_up = idx.get(pre + "experts.gate_up_proj")
    F = gate_up.shape[1] // 2
    out["expert_gate"] = np.swapaxes(gate_up[:, :F], 1, 2)
    out["expert_up"] = np.swapaxes(gate_up[:, F:], 1, 2)
    out["expert_down"] = np.swapaxes(idx.get(pre + "experts.down_proj"), 1, 2)
    return out
  for key, suffix in _EXPERT_MAP:
    out[key] = np.stack([idx.get(f"{pre}experts.{e}.{suffix}").T
                         for e in range(cfg.num_experts)])
  return out


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


class _TensorIndex:
  """Name -> file for a single or sharded safetensors checkpoint; lazy, memory-mapped reads."""

  def __init__(self, path: str):
    self._handles: dict[str, Any] = {}
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
      try:
        with open(index) as f:
          weight_map = json.load(f)["weight_map"]
      except (json.JSONDecodeError, KeyError) as e:
        raise ModelError(f"{index} is not a valid safetensors index ({e})") from None
      self.files = {k: os.path.join(path, v) for k, v in weight_map.items()}
    else:
      files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
      if not files:
        raise ModelError(f"no *.safetensors file in {path}")
      self.files: dict[str, str] = {}
      for fname in files:
        for name in self._open(os.path.join(path, fname)).keys():
          self.files[name] = os.path.join(path, fname)

  def _open(self, fname: str):
    if fname not in self._handles:
      if not os.path.exists(fname):
        raise ModelError(f"safetensors file {fname} is missing")
      try:
        handle = safe_open(fname, framework="flax")
      except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ModelError(f"safetensors file {fname} is corrupt or unreadable: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
      self._handles[fname] = handle
    return self._handles[fname]

  def __contains__(self, name: str) -> bool:
    return name in self.files

  def get(self, name: str) -> np.ndarray:
    if name not in self.files:
      raise ModelError(f"checkpoint lacks tensor {name!r}")
    fname = self.files[name]
    try:
      arr = self._open(fname).get_tensor(name)
    except ModelError:
      raise
    except Exception as e:
      raise ModelError(f"cannot read tensor {name!r} from {fname}: {e}") from None
    return np.asarray(jax.device_get(arr).astype(jnp.float32))


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

  Args:
    path: directory with config.json and model.safetensors (or sharded files + index).
    dtype: parameter storage dtype (float32 or bfloat16).
    compute_dtype: activation/matmul dtype (default: same as ``dtype``); float32 master
      weights with bfloat16 compute is ``dtype=jnp.float32, compute_dtype="bfloat16"``.
    shardings: optional pytree of NamedShardings (``transformer.param_shardings``); each
      tensor is placed straight onto its shards.
    overrides: ModelConfig fields to override (e.g. ``dtype="bfloat16", remat="full"``).
  Returns:
    (cfg, params).
  """
  dtype = jnp.dtype(dtype)
  compute = jnp.dtype(compute_dtype or dtype).name
  cfg = read_hf_config(path, param_dtype=dtype.name, dtype=compute, **overrides)
  idx = _TensorIndex(path)
  expected = tx.param_shapes(cfg)
  prefix = "model."

  def place(arr, where):
    return jax.device_put(jnp.asarray(arr, dtype), where) if where is not None else jnp.asarray(
        arr, dtype)

  def check(name, arr, shape):
    if tuple(arr.shape) != tuple(shape):
      raise ModelError(f"tensor {name!r} has shape {tuple(arr.shape)}, config.json implies "
                       f"{tuple(shape)}")
    return arr

  sh = shardings or {}
  params: dict[str, Any] = {}
  params["embed"] = place(check("embed", idx.get(prefix + "embed_tokens.weight"),
                                expected["embed"]), sh.get("embed"))
  params["final_norm"] = place(check("final_norm", idx.get(prefix + "norm.weight"),
                                     expected["final_norm"]), sh.get("final_norm"))
  if not cfg.tie_word_embeddings:
    if "lm_head.weight" not in idx:
      raise ModelError("checkpoint lacks 'lm_head.weight' but config.json says the "
                       "embeddings are untied")
    params["lm_head"] = place(check("lm_head", idx.get("lm_head.weight").T, expected["lm_head"]),
                              sh.get("lm_head"))
  layers = {}
  for key, suffix, kind in _layer_map(cfg):
    if key not in expected["layers"]:
      continue
    per_layer = []
    for i in range(cfg.num_layers):
      name = f"{prefix}layers.{i}.{suffix}"
      per_layer.append(check(name, _to_ours(cfg, kind, idx.get(name)),
                             expected["layers"][key][1:]))
    layers[key] = place(np.stack(per_layer), sh.get("layers", {}).get(key))
  params["layers"] = layers
  if cfg.is_moe:
    _load_mlp_stacks(cfg, idx, expected, params, place, check, sh)
  idx = per_layer = None  # noqa: F841  (drop the file handles and the last host tensors)
  release_host_memory()  # the host staging copies of the tensors, freed above
  return cfg, params


def _load_mlp_stacks(cfg, idx, expected, params, place, check, sh):
  """MoE models: ``params["moe"]`` over the Y MoE layers, ``params["mlp"]`` over the others."""
  if cfg.dense_layers:
    mlp = {}
    for key, suffix, kind in _LAYER_MAP:
      if key in _DENSE_MLP:
        rows = [check(f"model.layers.{i}.{suffix}", _to_ours(cfg, kind,
                                                             idx.get(f"model.layers.{i}.{suffix}")),
                      expected["mlp"][key][1:]) for i in cfg.dense_layers]
        mlp[key] = place(np.stack(rows), sh.get("mlp", {}).get(key))
    params["mlp"] = mlp
  stacks: dict[str, list] = {k: [] for k in expected["moe"]}
  for i in cfg.moe_layers:
    for key, arr in _load_experts(idx, cfg, i).items():
      stacks[key].append(check(f"model.layers.{i}.mlp.{key}", arr, expected["moe"][key][1:]))
  params["moe"] = {k: place(np.stack(v), sh.get("moe", {}).get(k)) for k, v in stacks.items()}


def release_host_memory() -> bool:
  """Hands the C heap's free pages back to the OS (glibc ``malloc_trim``); False where
  there is no glibc. The loader's host copies of the tensors (several MB each) are freed
  into the heap, which glibc otherwise keeps: a few hundred MB of a 0.6B model's load stay
  in the process's resident set for the whole run."""
  try:
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
  except (OSError, AttributeError, TypeError):
    return False
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


class _atomic_dir:  # pylint: disable=invalid-name
  """``with _atomic_dir(path) as tmp``: fill ``tmp``; it replaces ``path`` on success."""

  def __init__(self, path: str):
    self.path = path
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    self.tmp = tempfile.mkdtemp(prefix=".tmp_hf_", dir=parent)

  def __enter__(self) -> str:
    return self.tmp

  def __exit__(self, kind, value, tb):
    if kind is not None:
      shutil.rmtree(self.tmp, ignore_errors=True)
      return False
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


def save_hf(cfg: ModelConfig, params, path: str, max_shard_bytes: int = 4 << 30) -> str:
  """Write ``path`` (config.json + safetensors, sharded above ``max_shard_bytes``) atomically.

  The directory is assembled beside ``path`` and renamed into place; an existing ``path`` is
  replaced only once the new one is complete. bfloat16 weights are written as float32
  (numpy has no native bfloat16 in safetensors' numpy writer).
  """
  tensors = hf_state_dict(cfg, params)
  tensors = {k: v.astype(np.float32) if v.dtype not in (np.float32, np.float16) else v
             for k, v in tensors.items()}
  with _atomic_dir(path) as tmp:
    hf_cfg = to_hf_dict(cfg)
    hf_cfg["torch_dtype"] = str(next(iter(tensors.values())).dtype)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf_cfg, f, indent=2, sort_keys=True)
    shards, cur, size = [], {}, 0
    for name, arr in tensors.items():
      if cur and size + arr.nbytes > max_shard_bytes:
        shards.append(cur)
        cur, size = {}, 0
      cur[name] = arr
      size += arr.nbytes
    shards.append(cur)
    if len(shards) == 1:
      save_file(shards[0], os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    else:
      weight_map = {}
      for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
      total = sum(a.nbytes for a in tensors.values())
      with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return path
