"""GRPO on a local GSM8K-format file with a Hugging Face checkpoint: Qwen2, Qwen3, Llama,
Qwen3-MoE (``Qwen3MoeForCausalLM``) or Gemma 3 text (``Gemma3ForCausalLM``).

    python -m rl_jax.train --config=configs/gsm8k_hf.py --workdir=/tmp/gsm8k_run \\
        --config.model.hf_path=/models/Qwen3-0.6B --config.data.path=/data/gsm8k_train.jsonl

The checkpoint directory holds config.json, *.safetensors and tokenizer.json; the data file
is JSONL (or Parquet) with ``question`` and ``answer`` ("... #### 72") fields; rewards come
from math-verify on the completion's final answer. The same command runs on a CPU, a GPU or
a TPU slice: the mesh takes every visible device (FSDP over all of them by default; on a
large slice use ``--config.mesh.rules=fsdp_tp --config.mesh.shape.tensor=4``; on one host
``--config.mesh.sampler_tensor`` = its chips, 4 on v5p, 8 on v6e-8: docs/SCALING.md).
Prompts start with the tokenizer's bos where it prepends one (Gemma, Llama).
Mixture-of-experts checkpoints: add ``--config.model.router_replay=True`` (train on the
sampler's experts) and, for the load-balancing loss,
``--config.model.router_aux_loss_coef=0.001`` (off by default; the checkpoint's own
``router_aux_loss_coef`` is not applied).

Recipe (DeepSeekMath GRPO): N = 8 samples per prompt (rollout.n), ε = 0.2, k3 KL with
β = 0.001 (loss.kl_beta), seq-mean-token-mean aggregation, bf16 compute with float32 master
weights, per-layer rematerialisation.
"""

from rl_jax import config as base


def get_config(arg=None):
  del arg
  config = base.base_config()
  config.model.update(dtype="bfloat16", param_dtype="float32", remat="full")
  config.data.update(task="file", format="gsm8k", max_prompt_len=512, eval_size=256,
                     template="Question: {question}\nAnswer (end with '#### <number>'):",
                     reward_timeout_s=5.0)
  config.rollout.update(n=8, max_new_tokens=512, temperature=1.0)
  config.loss.update(preset="grpo", kl_beta=0.001)
  config.optim.update(lr=1e-6, grad_clip=1.0, warmup_steps=10)
  config.sft.steps = 0
  config.train.update(steps=500, batch_groups=32, minibatches=4, eval_every=50,
                      checkpoint_every=50, keep=3)
  config.eval.share_programs = False  # greedy eval: one row per prompt, not rollout.n
  config.log.tensorboard = True
  return config
