"""Llama / Qwen2 / Qwen3, Qwen3-MoE and Gemma 3 (text) decoders as pure sharded functions,
value heads, HF interop.

Public API (see shared Contract)::

    cfg, params = models.load_hf(path, dtype=jnp.float32)
    models.save_hf(cfg, params, path)
    logits = models.forward(cfg, params, tokens)            # [B,T] -> [B,T,V]
    lp = models.response_logprobs(cfg, params, prompt_tokens, prompt_lengths,
                                  response_tokens, response_mask, shared_prefix=True)

    # mixture of experts: recorded routing, router replay, load-balancing loss
    logits, routing = models.forward(cfg, params, tokens, return_routing=True)
    logits = models.forward(cfg, params, tokens, routing=routing.ids)
    aux = models.load_balancing_loss(routing.logits, cfg.num_experts_per_tok, mask)
    # (the trainer adds model.router_aux_loss_coef × aux; the checkpoint's
    #  cfg.router_aux_loss_coef is only carried through the HF round trip)

    # low-rank adapters beside the frozen base (cfg.lora_rank > 0; ``models.lora``)
    params = models.init_params(cfg, rng)                  # base + adapters (B = 0)
    base, adapters = models.lora.split(params)             # reference = base (adapters off)
    models.save_hf(cfg, params, path)                      # merged weights
    models.save_hf_adapter(cfg, params, path, base_model_name_or_path=base_path)  # PEFT
    adapters = models.load_hf_adapter(cfg, path, hf_path)  # a PEFT adapter, checked vs cfg
    # QLoRA: the base's projections stored int8/int4 (cfg.quant; ``models.quant``)
    params = models.quant.quantize_base(cfg, params)

Axis letters: the legend in the docstring of ``rl_jax/__init__.py``.
"""

from rl_jax.models.config import ModelConfig, from_hf_dict, rope_frequencies, to_hf_dict
from rl_jax.models.grouped import (packed_hidden, packs_rows, replicated_hidden,
                                   response_hidden, response_logprobs, token_reduction)
from rl_jax.models import lora, packing, quant
from rl_jax.models.hf import (check_hf_adapter, hf_adapter_state_dict, hf_state_dict, load_hf,
                              load_hf_adapter, read_hf_config, save_hf, save_hf_adapter)
from rl_jax.models.moe import Routing, load_balancing_loss
from rl_jax.models.transformer import (AttnSpec, apply_rope, cast_projections, causal_mask,
                                       dense_attention,
                                       embed, forward,
                                       hidden_states, init_params, init_sharded, lm_head_weight,
                                       logits_from_hidden, mask_attend, param_axes, param_shapes,
                                       param_shardings, rms_norm, rope_tables, sequence_logprobs,
                                       token_logprobs, trunk)
from rl_jax.models.value import init_value_params, response_values, value_axes, values

__all__ = [
    "AttnSpec",
    "ModelConfig",
    "Routing",
    "apply_rope",
    "cast_projections",
    "causal_mask",
    "check_hf_adapter",
    "dense_attention",
    "embed",
    "forward",
    "from_hf_dict",
    "hf_adapter_state_dict",
    "hf_state_dict",
    "hidden_states",
    "init_params",
    "init_sharded",
    "init_value_params",
    "lm_head_weight",
    "load_balancing_loss",
    "load_hf",
    "load_hf_adapter",
    "logits_from_hidden",
    "lora",
    "mask_attend",
    "packed_hidden",
    "packing",
    "packs_rows",
    "param_axes",
    "param_shapes",
    "param_shardings",
    "quant",
    "read_hf_config",
    "replicated_hidden",
    "response_hidden",
    "response_logprobs",
    "response_values",
    "rms_norm",
    "rope_tables",
    "rope_frequencies",
    "to_hf_dict",
    "save_hf",
    "save_hf_adapter",
    "sequence_logprobs",
    "token_logprobs",
    "token_reduction",
    "trunk",
    "value_axes",
    "values",
]
