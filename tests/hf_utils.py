"""Tiny random `transformers` models saved with save_pretrained, for parity tests."""

from __future__ import annotations

import numpy as np
import torch
import transformers

_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}
# family fields of the tiny models: 4 experts, top 2 (renormalised), expert width inter // 2;
# Gemma 3 alternating sliding (window 4) and global layers, a final soft-cap
_FAMILY = {
    "qwen3_moe": lambda inter, layers: dict(num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=inter // 2,
                                            norm_topk_prob=True),
    "gemma3_text": lambda inter, layers: dict(
        sliding_window=4, final_logit_softcapping=30.0,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(layers)]),
}


def tiny_hf_model(arch: str, path, *, vocab=61, hidden=48, inter=72, layers=2, heads=4,
                  kv_heads=2, head_dim=None, tied=False, rope_scaling=None, seed=0,
                  attention_bias=False, max_pos=256):
  """Build, randomise (incl. biases and norms) and save a tiny HF causal LM; return the model.

  ``arch``: a key of ``_CLASSES`` (HF model_type); qwen3_moe and gemma3_text add the
  ``_FAMILY`` fields (Gemma's norms are stored as offsets from 1, randomised around 0)."""
  config_cls, model_cls = _CLASSES[arch]
  kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            max_position_embeddings=max_pos, tie_word_embeddings=tied, rms_norm_eps=1e-6)
  if arch != "gemma3_text":  # Gemma 3: its own global and local RoPE bases
    kw["rope_theta"] = 10000.0
  kw.update(_FAMILY.get(arch, lambda *_: {})(inter, layers))
  if head_dim is not None:
    kw["head_dim"] = head_dim
  if rope_scaling is not None:
    kw["rope_scaling"] = rope_scaling
  if arch != "qwen2":
    kw["attention_bias"] = attention_bias
  torch.manual_seed(seed)
  model = model_cls(config_cls(**kw)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_((0.0 if arch == "gemma3_text" else 1.0) + 0.1 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.1 * torch.randn_like(p))
      else:
        p.copy_(0.05 * torch.randn_like(p))
  model.save_pretrained(str(path), safe_serialization=True)
  return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()
