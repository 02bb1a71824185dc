"""Decoder configuration (Llama / Qwen2 / Qwen3 dense, Qwen3-MoE, Gemma 3 text) and HF
``config.json`` mapping."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from rl_jax.errors import ModelError

__all__ = ["ARCHITECTURES", "ATTENTION_LAYOUTS", "DTYPES", "LAYER_TYPES", "LORA_TARGETS",
           "PREFIX_ATTENTIONS", "QUANTS", "SAMPLER_QUANTS", "REMAT_POLICIES", "ROPE_TYPES", "ModelConfig",
           "from_hf_dict", "quant_block_problem", "rope_frequencies", "to_hf_dict", "validate"]

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3")
LAYER_TYPES = ("full_attention", "sliding_attention")
ATTENTION_LAYOUTS = ("full", "sliding")  # model.attention: all global / Gemma 3 interleave
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
REMAT_POLICIES = ("none", "full", "dots")
# model.prefix_attention: how the packed training layout attends responses to their prompt
PREFIX_ATTENTIONS = ("auto", "kernel", "concat")
FUSED_MLPS = ("auto", True, False)  # model.fused_mlp: "auto" is on for CPU programs only
DTYPES = ("float32", "bfloat16", "float16")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # projections LoRA can adapt


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
    fused_mlp: dense SwiGLU and GeGLU MLPs: one gate/up matmul against the two weights
      concatenated at compute time (the parameters keep their names and layout); without
      adapters on gate/up/down the SwiGLU MLP is ``transformer.swiglu_mlp`` with a
      hand-written backward. LoRA adapters on gate/up add their deltas to the fused outputs.
      False: two matmuls and autodiff. Equal to float rounding; expert MLPs are unaffected.
      "auto" (default): on in programs compiled for CPUs (1.1-1.2x on the update there),
      off for TPUs and GPUs (``transformer.fused_mlp_on``).
    scan_layers: run the stacked layers under ``lax.scan`` (one compiled layer: fast
      compiles); False unrolls the layer loop in the compiled program (no per-layer slicing
      of the stacked weights and their gradients; longer compiles). Equal to float rounding.
    prefix_attention: the response queries' attention in the packed (prompt-once) training
      layout. "kernel": ``pallas_kernels.shared_prefix_attention`` (the Pallas kernel on
      TPU/GPU, elsewhere its jnp reference: two partial softmaxes merged by log-sum-exp).
      "concat": ``transformer.concat_prefix_attention``, the group's context keys placed in
      front of each response's own keys and one masked softmax in a head-major layout (fewer
      passes and transposes over the [R, P+R] scores: faster on CPU; materialises them, so
      not for long responses on accelerators). "auto" (the default): "concat" when the
      program is compiled for CPUs, "kernel" for TPUs and GPUs (the platform of the mesh it
      is compiled for: ``pallas_kernels.current_platform``). Equal to float rounding; models
      with sliding-window layers and sequence parallelism keep their own paths. The same
      choice for the sampler's decode: "kernel" attends the prompt and the response pages
      as two partial softmaxes merged by log-sum-exp, the pages read in place by
      ``pallas_kernels.paged_decode_attention`` (Pallas on TPU/GPU, its jnp reference on
      CPU); "concat" one softmax over the prompt and the gathered live pages
      (``rollout.decode``).

  Mixture of experts (``qwen3_moe``; all zero/empty for dense families):
    num_experts [E]; num_experts_per_tok [X]; moe_intermediate_size: expert MLP width.
    norm_topk_prob: renormalise the X routing weights to sum to one.
    sparse_layers: per-layer flags (length L), True where the MLP is a mixture of experts
      (from ``decoder_sparse_step`` / ``mlp_only_layers``); the others use a dense SwiGLU MLP
      of ``intermediate_size``.
    router_aux_loss_coef: the checkpoint's weight of the load-balancing loss
      (``moe.load_balancing_loss``), kept for the HF round trip; the trainer does not apply
      it (its switch is the train config's ``model.router_aux_loss_coef``, default 0).
    moe_capacity_factor: 0 = dropless grouped matmuls; > 0 = per-expert capacity
      C = ceil(factor · N · X / E) per token shard with expert-parallel all-to-all dispatch
      on a mesh; assignments past C are dropped (``moe.capacity_mlp``).

  Gemma 3 (``gemma3``; None for the other families):
    layer_types: per-layer "full_attention" / "sliding_attention" (length L).
    sliding_window: keys at most ``sliding_window - 1`` positions behind the query are visible
      in sliding layers. rope_local_theta: RoPE base of sliding layers (no scaling); global
      layers use rope_theta and rope_scaling.
    query_pre_attn_scalar: attention scores are scaled by its -1/2 power (not head_dim's).
    final_softcap: output logits become ``c·tanh(logits/c)``. (Gemma 3 checkpoints may carry
      ``attn_logit_softcapping``; transformers' Gemma 3 attention does not apply it, and
      neither does this model.)

  Low-rank adapters (``rl_jax.models.lora``; off with ``lora_rank=0``):
    lora_rank: r, the adapters' rank. lora_alpha: α; the adapters add (α/r)·x·A·B.
    lora_targets: the adapted projections, names from ``LORA_TARGETS``.
    lora_dtype: storage dtype of the adapters (``""``: ``param_dtype``). With adapters,
      ``param_dtype`` is the frozen base's dtype, which needs no float32 master copy: the
      trainer keeps the base in the compute dtype and the adapters in float32 by default.

  Quantised base (QLoRA; ``rl_jax.models.quant``):
    quant: ``""`` (weights in ``param_dtype``), ``"int8"`` or ``"int4"``: the dense
      projections of the layers are stored as integers with float32 per-block scales.
    quant_block: entries per scale along each projection's last contraction axis; must
      divide hidden_size, head_dim and intermediate_size.
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
  fused_mlp: bool | str = "auto"
  scan_layers: bool = True
  prefix_attention: str = "auto"
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False
  sparse_layers: tuple[bool, ...] | None = None
  router_aux_loss_coef: float = 0.0
  moe_capacity_factor: float = 0.0
  layer_types: tuple[str, ...] | None = None
  sliding_window: int | None = None
  rope_local_theta: float | None = None
  query_pre_attn_scalar: float | None = None
  final_softcap: float | None = None
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ()
  lora_dtype: str = ""
  quant: str = ""
  quant_block: int = 64

  def __post_init__(self):
    validate(self)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  @property
  def rope(self) -> dict[str, Any]:
    return dict(self.rope_scaling or ())

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  @property
  def moe_layers(self) -> tuple[int, ...]:
    """Indices of the mixture-of-experts layers (Y of them)."""
    return tuple(i for i, s in enumerate(self.sparse_layers or ()) if s)

  @property
  def dense_layers(self) -> tuple[int, ...]:
    """Indices of the layers with a dense MLP."""
    sparse = self.sparse_layers or (False,) * self.num_layers
    return tuple(i for i, s in enumerate(sparse) if not s)

  @property
  def sliding_layers(self) -> tuple[bool, ...]:
    """Per layer: attention restricted to the sliding window."""
    return tuple(t == "sliding_attention" for t in (self.layer_types or
                                                    ("full_attention",) * self.num_layers))

  @property
  def per_layer_attention(self) -> bool:
    """Attention differs between layers (sliding-window layers): attention functions then
    receive an ``AttnSpec``."""
    return any(self.sliding_layers)

  def expert_params(self) -> int:
    """Parameters in expert MLPs (all experts, all MoE layers); routers excluded."""
    return len(self.moe_layers) * self.num_experts * 3 * self.hidden_size * \
        self.moe_intermediate_size

  def active_expert_params(self) -> int:
    """Expert parameters one token passes through (X experts per MoE layer)."""
    return len(self.moe_layers) * self.num_experts_per_tok * 3 * self.hidden_size * \
        self.moe_intermediate_size

  def num_params(self) -> int:
    d, f, h, v = self.hidden_size, self.intermediate_size, self.head_dim, self.vocab_size
    attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
    if not self.is_moe and self.architecture != "gemma3":
      per_layer = attn + 3 * d * f + 2 * d
      return v * d * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + d
    norms = (4 if self.architecture == "gemma3" else 2) * d
    norms += 2 * h if self.qk_norm else 0
    dense = len(self.dense_layers) * 3 * d * f
    routers = len(self.moe_layers) * d * self.num_experts
    return (v * d * (1 if self.tie_word_embeddings else 2) + self.num_layers * (attn + norms)
            + dense + routers + self.expert_params() + d)


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
  if cfg.lora_dtype not in ("", *DTYPES):
    raise ModelError(f"model config: lora_dtype must be '' or in {DTYPES}, got "
                     f"{cfg.lora_dtype!r}")
  if cfg.prefix_attention not in PREFIX_ATTENTIONS:
    raise ModelError(f"model config: prefix_attention={cfg.prefix_attention!r}; choose one of "
                     f"{PREFIX_ATTENTIONS}")
  if not any(cfg.fused_mlp is v or cfg.fused_mlp == v for v in FUSED_MLPS
             if isinstance(v, str) == isinstance(cfg.fused_mlp, str)):
    raise ModelError(f"model config: fused_mlp={cfg.fused_mlp!r}; choose one of {FUSED_MLPS}")
  if cfg.remat not in REMAT_POLICIES:
    raise ModelError(f"model config: remat={cfg.remat!r}; choose one of {REMAT_POLICIES}")
  rope_type = cfg.rope.get("rope_type", "default")
  if rope_type not in ROPE_TYPES:
    raise ModelError(f"model config: rope scaling type {rope_type!r} is not supported; "
                     f"choose one of {ROPE_TYPES}")
  if not isinstance(cfg.moe_capacity_factor, (int, float)) or cfg.moe_capacity_factor < 0:
    raise ModelError(f"model config: moe_capacity_factor must be a number >= 0 (0: dropless), "
                     f"got {cfg.moe_capacity_factor!r}")
  if cfg.architecture == "qwen3_moe":
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
      value = getattr(cfg, name)
      if not isinstance(value, (int, np.integer)) or value <= 0:
        raise ModelError(f"model config: {name} must be a positive integer for qwen3_moe, "
                         f"got {value!r}")
    if cfg.num_experts_per_tok > cfg.num_experts:
      raise ModelError(f"model config: num_experts_per_tok={cfg.num_experts_per_tok} exceeds "
                       f"num_experts={cfg.num_experts}")
    if cfg.sparse_layers is None or len(cfg.sparse_layers) != cfg.num_layers:
      raise ModelError(f"model config: sparse_layers must have num_layers={cfg.num_layers} "
                       f"flags, got {cfg.sparse_layers!r}")
  elif cfg.num_experts or cfg.sparse_layers:
    raise ModelError(f"model config: num_experts/sparse_layers need architecture 'qwen3_moe', "
                     f"got {cfg.architecture!r}")
  if cfg.layer_types is not None:
    if len(cfg.layer_types) != cfg.num_layers or any(t not in LAYER_TYPES
                                                     for t in cfg.layer_types):
      raise ModelError(f"model config: layer_types must list num_layers={cfg.num_layers} of "
                       f"{LAYER_TYPES}, got {cfg.layer_types!r}")
    if any(cfg.sliding_layers) and (not isinstance(cfg.sliding_window, (int, np.integer))
                                    or cfg.sliding_window <= 0):
      raise ModelError(f"model config: sliding_window must be a positive integer when "
                       f"layer_types has sliding layers, got {cfg.sliding_window!r}")
  _validate_lora(cfg)
  _validate_quant(cfg)
  gemma_only = ("layer_types", "rope_local_theta", "query_pre_attn_scalar", "final_softcap")
  if cfg.architecture != "gemma3":
    for name in gemma_only:
      if getattr(cfg, name) is not None:
        raise ModelError(f"model config: {name} needs architecture 'gemma3', "
                         f"got {cfg.architecture!r}")


def _validate_lora(cfg: ModelConfig) -> None:
  if not isinstance(cfg.lora_rank, (int, np.integer)) or cfg.lora_rank < 0:
    raise ModelError(f"model config: lora_rank must be a non-negative integer, got "
                     f"{cfg.lora_rank!r}")
  if not cfg.lora_rank:
    return
  if not cfg.lora_targets or any(t not in LORA_TARGETS for t in cfg.lora_targets) or \
      len(set(cfg.lora_targets)) != len(cfg.lora_targets):
    raise ModelError(f"model config: lora_targets must be distinct names from {LORA_TARGETS}, "
                     f"got {cfg.lora_targets!r}")
  if cfg.is_moe and set(cfg.lora_targets) & {"gate", "up", "down"}:
    raise ModelError("model config: LoRA adapts the attention projections of mixture-of-"
                     "experts models (lora_targets from q,k,v,o)")


QUANTS = ("", "int8", "int4", "fp8")  # quant: "" keeps the base in param_dtype
# rollout.weight_dtype: "" decodes in the trainer's dtype, else the sampler's quantised weights
SAMPLER_QUANTS = ("", "int8", "fp8")


def quant_block_problem(cfg: ModelConfig, block) -> str | None:
  """None if ``block`` can be the quantisation block of ``cfg``'s projections (a positive
  integer dividing each contraction axis that is blocked), else what it must be."""
  dims = {"hidden_size": cfg.hidden_size, "head_dim": cfg.head_dim}
  if not cfg.is_moe:  # MoE experts stay unquantised
    dims["intermediate_size"] = cfg.intermediate_size
  if isinstance(block, (int, np.integer)) and block > 0 and not any(d % block for d in
                                                                    dims.values()):
    return None
  return (f"must be a positive integer dividing "
          f"{', '.join(f'{k}={v}' for k, v in dims.items())}")


def _validate_quant(cfg: ModelConfig) -> None:
  if cfg.quant not in QUANTS:
    raise ModelError(f"model config: quant must be one of {QUANTS}, got {cfg.quant!r}")
  problem = quant_block_problem(cfg, cfg.quant_block) if cfg.quant else None
  if problem:
    raise ModelError(f"model config: quant_block {problem}, got {cfg.quant_block!r}")


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
_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama",
                   "qwen3_moe": "qwen3_moe", "gemma3_text": "gemma3"}
_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "gemma3": "Gemma3ForCausalLM"}
_HF_TYPE_NAMES = {"gemma3": "gemma3_text"}
# Config fields of other routing schemes (grouped top-k, sigmoid scores, shared experts...):
# a checkpoint that sets any of them is not the softmax top-k router implemented here.
_OTHER_ROUTING_FIELDS = ("scoring_func", "topk_method", "n_group", "topk_group",
                         "n_shared_experts", "shared_expert_intermediate_size",
                         "routed_scaling_factor", "moe_layer_freq", "first_k_dense_replace")
_GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


def _first_id(value):
  if isinstance(value, (list, tuple)):
    return int(value[0]) if value else None
  return None if value is None else int(value)


# RoPE scaling fields that ``rope_frequencies`` reads as numbers: name -> must be positive
_ROPE_NUMBERS = {"factor": True, "original_max_position_embeddings": True,
                 "low_freq_factor": True, "high_freq_factor": True, "beta_fast": True,
                 "beta_slow": True, "attention_factor": True, "mscale": False,
                 "mscale_all_dim": False}
_ROPE_OPTIONAL = ("attention_factor", "mscale", "mscale_all_dim")  # null: computed / unset


def _rope_number(field: str, value: Any, positive: bool) -> None:
  """ModelError (one line) unless ``value`` is a finite number (> 0 if ``positive``)."""
  number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
  if number and math.isfinite(value) and (value > 0 or not positive):
    return
  raise ModelError(f"config.json {field}={value!r} must be a "
                   f"{'positive ' if positive else ''}number")


def _check_rope_numbers(theta: Any, scaling: Mapping[str, Any]) -> None:
  """The RoPE base and the numeric scaling fields of a config.json, checked at load (not
  when the first forward pass reads them)."""
  _rope_number("rope_theta", theta, True)
  optional = _ROPE_OPTIONAL
  if scaling.get("rope_type") == "yarn":  # null: max_position_embeddings
    optional += ("original_max_position_embeddings",)
  for name, positive in _ROPE_NUMBERS.items():
    if name in scaling and not (scaling[name] is None and name in optional):
      _rope_number(f"RoPE scaling {name}", scaling[name], positive)


def _rope_fields(params: Mapping[str, Any], legacy: Mapping[str, Any], default_theta: float):
  """(theta, scaling pairs or None) from a ``rope_parameters`` dict plus legacy fields."""
  if not isinstance(legacy.get("rope_scaling") or {}, Mapping):
    raise ModelError(f"config.json rope_scaling={legacy['rope_scaling']!r} must be a JSON "
                     "object or null")
  scaling = dict(legacy.get("rope_scaling") or {})
  scaling.update({k: v for k, v in params.items() if k != "rope_theta"})
  if "type" in scaling and "rope_type" not in scaling:
    scaling["rope_type"] = scaling.pop("type")
  scaling.pop("type", None)
  theta = params.get("rope_theta", legacy.get("rope_theta", default_theta))
  if scaling.get("rope_type", "default") == "default":
    scaling = {}
  _check_rope_numbers(theta, scaling)
  return float(theta), tuple(sorted(scaling.items())) or None


def _moe_fields(hf: Mapping[str, Any], layers: int) -> dict[str, Any]:
  """Qwen3-MoE routing fields of an HF config (ModelError names an unsupported one)."""
  for name in _OTHER_ROUTING_FIELDS:
    if hf.get(name) not in (None, 0):
      raise ModelError(f"config.json sets {name}={hf[name]!r}: only softmax top-k routing "
                       f"without shared experts is supported")
  experts = hf.get("num_experts", hf.get("num_local_experts"))
  if experts is None:
    raise ModelError("config.json lacks the required field 'num_experts'")
  step = int(hf.get("decoder_sparse_step", 1) or 1)
  dense = set(int(i) for i in (hf.get("mlp_only_layers") or ()))
  sparse = tuple(i not in dense and int(experts) > 0 and (i + 1) % step == 0
                 for i in range(layers))
  try:
    return dict(num_experts=int(experts), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), sparse_layers=sparse,
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0) or 0.0))
  except KeyError as e:
    raise ModelError(f"config.json lacks the required field {e.args[0]!r}") from None


def _gemma_fields(hf: Mapping[str, Any], layers: int) -> dict[str, Any]:
  """Gemma 3 text fields: layer types, two RoPE bases, scalings and soft-caps."""
  act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
  if act not in _GEMMA_ACTIVATIONS:
    raise ModelError(f"config.json hidden_activation {act!r} is not supported "
                     f"(only {_GEMMA_ACTIVATIONS[0]})")
  if hf.get("use_bidirectional_attention"):
    raise ModelError("config.json sets use_bidirectional_attention, which is not supported")
  types = hf.get("layer_types")
  if types is None:
    pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
    types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
             for i in range(layers)]
  bad = sorted(set(types) - set(LAYER_TYPES))
  if bad:
    raise ModelError(f"config.json layer_types has unsupported attention {bad[0]!r}; "
                     f"supported: {list(LAYER_TYPES)}")
  rope = dict(hf.get("rope_parameters") or {})
  if rope and set(rope) <= set(LAYER_TYPES):
    glob, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
  else:  # one dict for the global layers (older files), local base separate
    glob, local = rope, {}
  theta, scaling = _rope_fields(glob, hf, 1_000_000.0)
  local_theta, local_scaling = _rope_fields(
      local, {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}, 10_000.0)
  if local_scaling:
    raise ModelError(f"config.json rope_parameters.sliding_attention scaling "
                     f"{dict(local_scaling)} is not supported (default RoPE only)")
  window = hf.get("sliding_window")
  cap = lambda name: None if hf.get(name) is None else float(hf[name])
  return dict(layer_types=tuple(types), sliding_window=None if window is None else int(window),
              rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
              query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
              final_softcap=cap("final_logit_softcapping"),
              tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), qk_norm=True)


def from_hf_dict(hf: Mapping[str, Any], **overrides) -> ModelConfig:
  """Build a ModelConfig from a parsed HF ``config.json``. Raises ModelError if unsupported."""
  if not isinstance(hf, Mapping):
    raise ModelError(f"config.json must hold a JSON object, not a {type(hf).__name__}")
  model_type = hf.get("model_type")
  if model_type not in _HF_MODEL_TYPES:
    raise ModelError(f"config.json model_type {model_type!r} is not supported; supported: "
                     f"{sorted(_HF_MODEL_TYPES)}")
  arch = _HF_MODEL_TYPES[model_type]
  if arch != "gemma3":
    act = hf.get("hidden_act", "silu")
    if act != "silu":
      raise ModelError(f"config.json hidden_act {act!r} is not supported (only silu)")
  if hf.get("use_sliding_window") or (model_type == "mistral" and hf.get("sliding_window")):
    raise ModelError("config.json enables sliding-window attention, which is not supported")
  try:
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    layers = int(hf["num_hidden_layers"])
    theta, scaling = _rope_fields(dict(hf.get("rope_parameters") or {}), hf, 10000.0)
    attention_bias = bool(hf.get("attention_bias", False))
    kw = dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        architecture=arch,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if arch == "qwen2" else attention_bias,
        o_bias=False if arch == "qwen2" else attention_bias,
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        bos_token_id=_first_id(hf.get("bos_token_id")),
        eos_token_id=_first_id(hf.get("eos_token_id")),
    )
    if arch == "gemma3":
      kw.update(_gemma_fields(hf, layers))
    else:
      kw.update(rope_theta=theta, rope_scaling=scaling)
    if arch == "qwen3_moe":
      kw.update(_moe_fields(hf, layers))
  except KeyError as e:
    raise ModelError(f"config.json lacks the required field {e.args[0]!r}") from None
  if hf.get("mlp_bias"):
    raise ModelError("config.json sets mlp_bias, which is not supported")
  kw.update(overrides)
  return ModelConfig(**kw)


def _number(x):
  """An integral float as int (HF's typed configs declare some of these fields int)."""
  return int(x) if x is not None and float(x).is_integer() else x


def to_hf_dict(cfg: ModelConfig) -> dict[str, Any]:
  """HF ``config.json`` contents that ``transformers`` loads as the same architecture."""
  out = {
      "architectures": [_HF_CLASSES[cfg.architecture]],
      "model_type": _HF_TYPE_NAMES.get(cfg.architecture, cfg.architecture),
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
  if (cfg.architecture in ("qwen3", "qwen3_moe", "gemma3")) != cfg.qk_norm:
    raise ModelError(f"qk_norm={cfg.qk_norm} does not match the {cfg.architecture} "
                     f"architecture in HF format")
  if cfg.architecture == "qwen3_moe":
    step_dense = [i for i, s in enumerate(cfg.sparse_layers) if not s]
    out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
               moe_intermediate_size=cfg.moe_intermediate_size,
               norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
               mlp_only_layers=step_dense, router_aux_loss_coef=cfg.router_aux_loss_coef,
               use_sliding_window=False)
  if cfg.architecture == "gemma3":
    full = {"rope_type": "default", **dict(cfg.rope_scaling or ()), "rope_theta": cfg.rope_theta}
    del out["hidden_act"], out["rope_theta"], out["rope_scaling"]
    out.update(hidden_activation="gelu_pytorch_tanh", layer_types=list(cfg.layer_types),
               sliding_window=cfg.sliding_window,
               rope_parameters={"full_attention": full,
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": cfg.rope_local_theta}},
               query_pre_attn_scalar=_number(cfg.query_pre_attn_scalar),
               final_logit_softcapping=cfg.final_softcap,
               use_bidirectional_attention=False)
  return out
