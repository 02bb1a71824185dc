"""Decoder configuration for the Llama / Qwen2 / Qwen3 families and HF ``config.json`` mapping."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from rl_jax.errors import ModelError

__all__ = ["ARCHITECTURES", "DTYPES", "REMAT_POLICIES", "ROPE_TYPES", "ModelConfig",
           "from_hf_dict", "rope_frequencies", "to_hf_dict", "validate"]

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
REMAT_POLICIES = ("none", "full", "dots")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyperparameters of one decoder. Hashable, so it is a static argument of jitted functions.

  Attributes (letters of the legend in ``rl_jax/__init__.py`` in brackets):
    vocab_size [V], hidden_size [D], intermediate_size [F], num_layers [L],
    num_heads [N], num_kv_heads [K], head_dim [H].
    rope_theta: RoPE base. rope_scaling: ``(("rope_type", "llama3"), ("factor", 8.0), ...)``
      as sorted key/value pairs (hashable), or None.
    qkv_bias: biases on the q/k/v projections (Qwen2). o_bias: bias on the output projection.
    qk_norm: RMSNorm over the head dimension of q and k before RoPE (Qwen3).
    tie_word_embeddings: LM head is the transposed token embedding.
    dtype: compute dtype of activations and matmuls. param_dtype: storage dtype of weights
      (float32 master weights with bfloat16 compute is ``param_dtype="float32", dtype="bfloat16"``).
    remat: rematerialisation per layer: "none", "full" (recompute everything), "dots"
      (save matmul outputs without batch dims).
    logits_chunk: sequence chunk for log-prob computation, so [T, V] logits are never whole.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  architecture: str = "llama"
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  qk_norm: bool = False
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: str = "none"
  logits_chunk: int = 512
  bos_token_id: int | None = None
  eos_token_id: int | None = None

  def __post_init__(self):
    validate(self)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  @property
  def rope(self) -> dict[str, Any]:
    return dict(self.rope_scaling or ())

  def num_params(self) -> int:
    d, f, h, v = self.hidden_size, self.intermediate_size, self.head_dim, self.vocab_size
    attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
    per_layer = attn + 3 * d * f + 2 * d
    return v * d * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + d


def validate(cfg: ModelConfig) -> None:
  """Raise ModelError (one line) for an inconsistent configuration."""
  for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "head_dim", "logits_chunk"):
    value = getattr(cfg, name)
    if not isinstance(value, (int, np.integer)) or value <= 0:
      raise ModelError(f"model config: {name} must be a positive integer, got {value!r}")
  if cfg.architecture not in ARCHITECTURES:
    raise ModelError(f"model config: architecture {cfg.architecture!r} is not supported; "
                     f"choose one of {ARCHITECTURES}")
  if cfg.num_heads % cfg.num_kv_heads:
    raise ModelError(f"model config: num_heads={cfg.num_heads} is not a multiple of "
                     f"num_kv_heads={cfg.num_kv_heads}")
  if cfg.head_dim % 2:
    raise ModelError(f"model config: head_dim={cfg.head_dim} must be even for RoPE")
  if cfg.dtype not in DTYPES or cfg.param_dtype not in DTYPES:
    raise ModelError(f"model config: dtype/param_dtype must be in {DTYPES}, got "
                     f"{cfg.dtype!r}/{cfg.param_dtype!r}")
  if cfg.remat not in REMAT_POLICIES:
    raise ModelError(f"model config: remat={cfg.remat!r}; choose one of {REMAT_POLICIES}")
  rope_type = cfg.rope.get("rope_type", "default")
  if rope_type not in ROPE_TYPES:
    raise ModelError(f"model config: rope scaling type {rope_type!r} is not supported; "
                     f"choose one of {ROPE_TYPES}")


# ------------------------------------------------------------------------------- RoPE tables
def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
  """Inverse frequencies [H/2] and the attention (magnitude) factor for cfg's RoPE variant.

  Variants: default; linear (position interpolation); llama3 (wavelength-banded scaling);
  yarn (NTK-by-parts interpolation with magnitude scaling).
  References: Su et al. 2021 (RoFormer); Chen et al. 2023 (position interpolation);
    Peng et al. 2023 (YaRN); Llama 3 report (Meta 2024).
  """
  dim, base = cfg.head_dim, float(cfg.rope_theta)
  rope = cfg.rope
  kind = rope.get("rope_type", "default")
  inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
  factor = float(rope.get("factor", 1.0))
  if kind == "default":
    return inv.astype(np.float32), 1.0
  if kind == "linear":
    return (inv / factor).astype(np.float32), 1.0
  if kind == "llama3":
    old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
  # yarn
  old_ctx = float(rope.get("original_max_position_embeddings") or cfg.max_position_embeddings)

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  attn_factor = rope.get("attention_factor")
  if attn_factor is None:
    m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
    attn_factor = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
  beta_fast, beta_slow = float(rope.get("beta_fast", 32.0)), float(rope.get("beta_slow", 1.0))

  def correction_dim(rotations):
    return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

  lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
  if rope.get("truncate", True):
    lo, hi = math.floor(lo), math.ceil(hi)
  lo, hi = max(lo, 0), min(hi, dim - 1)
  if lo == hi:
    hi += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
  extrapolation = 1 - ramp
  inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
  return inv.astype(np.float32), float(attn_factor)


# ------------------------------------------------------------------------------ HF mapping
_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}
_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}


def _first_id(value):
  if isinstance(value, (list, tuple)):
    return int(value[0]) if value else None
  return None if value is None else int(value)


def from_hf_dict(hf: Mapping[str, Any], **overrides) -> ModelConfig:
  """Build a ModelConfig from a parsed HF ``config.json``. Raises ModelError if unsupported."""
  model_type = hf.get("model_type")
  if model_type not in _HF_MODEL_TYPES:
    raise ModelError(f"config.json model_type {model_type!r} is not supported; supported: "
                     f"{sorted(_HF_MODEL_TYPES)}")
  arch = _HF_MODEL_TYPES[model_type]
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ModelError(f"config.json hidden_act {act!r} is not supported (only silu)")
  if hf.get("use_sliding_window") or (model_type == "mistral" and hf.get("sliding_window")):
    raise ModelError("config.json enables sliding-window attention, which is not supported")
  try:
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    rope_params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    scaling.update({k: v for k, v in rope_params.items() if k != "rope_theta"})
    if "type" in scaling and "rope_type" not in scaling:
      scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    theta = rope_params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if scaling.get("rope_type", "default") == "default":
      scaling = {}
    attention_bias = bool(hf.get("attention_bias", False))
    kw = dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        architecture=arch,
        rope_theta=float(theta),
        rope_scaling=tuple(sorted(scaling.items())) or None,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if arch == "qwen2" else attention_bias,
        o_bias=False if arch == "qwen2" else attention_bias,
        qk_norm=arch == "qwen3",
        bos_token_id=_first_id(hf.get("bos_token_id")),
        eos_token_id=_first_id(hf.get("eos_token_id")),
    )
  except KeyError as e:
    raise ModelError(f"config.json lacks the required field {e.args[0]!r}") from None
  if hf.get("mlp_bias"):
    raise ModelError("config.json sets mlp_bias, which is not supported")
  kw.update(overrides)
  return ModelConfig(**kw)


def to_hf_dict(cfg: ModelConfig) -> dict[str, Any]:
  """HF ``config.json`` contents that ``transformers`` loads as the same architecture."""
  out = {
      "architectures": [_HF_CLASSES[cfg.architecture]],
      "model_type": cfg.architecture,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_position_embeddings,
      "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
      "tie_word_embeddings": cfg.tie_word_embeddings,
      "torch_dtype": cfg.param_dtype,
      "bos_token_id": cfg.bos_token_id,
      "eos_token_id": cfg.eos_token_id,
  }
  if cfg.architecture == "qwen2":
    if cfg.o_bias or not cfg.qkv_bias:
      raise ModelError("qwen2 checkpoints have q/k/v biases and no output bias")
    out["use_sliding_window"] = False
  else:
    if cfg.qkv_bias != cfg.o_bias:
      raise ModelError(f"{cfg.architecture} checkpoints have all attention biases or none")
    out["attention_bias"] = cfg.qkv_bias
  if (cfg.architecture == "qwen3") != cfg.qk_norm:
    raise ModelError("qk_norm is exactly the qwen3 architecture in HF format")
  return out
