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
import re
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

__all__ = ["check_hf_adapter", "hf_adapter_state_dict", "hf_state_dict", "load_hf",
           "load_hf_adapter", "read_hf_config", "save_hf", "save_hf_adapter",
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


# PEFT module name -> LoRA target ("q_proj" -> "q")
_PEFT_TARGETS = {m.split(".")[1]: t for t, m in _PEFT_MODULES.items()}
_PEFT_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                       r"\.lora_([AB])(?:\.[\w-]+)?\.weight$")
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
  if r != cfg.lora_rank:
    raise ModelError(f"adapter_config.json r={r!r} but model.lora.rank={cfg.lora_rank}; set "
                     f"model.lora.rank={r}")
  alpha = config.get("lora_alpha")
  if not isinstance(alpha, (int, float)) or not np.isclose(alpha, cfg.lora_alpha):
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
  arrays in ``dtype`` (default ``cfg.param_dtype``), target -> {"a": [L,<in>,r],
  "b": [L,r,<out>]}, the inverse of ``hf_adapter_state_dict``: A = A_hf.T.reshape(<in>, r),
  B = B_hf.T.reshape(r, <out>)."""
  check_hf_adapter(cfg, path, hf_path)
  _, fname = _read_adapter(path)
  handle = _open_adapter(fname)
  by_key = {}
  for name in handle.keys():
    m = _PEFT_KEY.match(name)
    by_key[(_PEFT_TARGETS[m.group(2)], int(m.group(1)), m.group(3))] = name
  dtype = jnp.dtype(dtype or cfg.param_dtype)
  get = lambda name: np.asarray(jax.device_get(handle.get_tensor(name).astype(jnp.float32)))
  out = {}
  for t, shape in lora.adapter_shapes(cfg).items():
    a = [get(by_key[(t, i, "A")]).T.reshape(shape["a"][1:]) for i in range(cfg.num_layers)]
    b = [get(by_key[(t, i, "B")]).T.reshape(shape["b"][1:]) for i in range(cfg.num_layers)]
    out[t] = {"a": np.stack(a).astype(dtype), "b": np.stack(b).astype(dtype)}
  return out


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
