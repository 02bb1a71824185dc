"""Quickstart: a tiny character-level policy learns a verifiable task on a laptop CPU.

    python -m rl_jax.train --config=configs/quickstart.py --workdir=/tmp/rl_jax_quickstart

Stage 1 (``sft``): a short supervised warm start on prompt/answer pairs of the train split.
Stage 2 (``train``): GRPO (group-normalised advantages, PPO clip ε=0.2, N=8 samples per
prompt, k3 KL β=0) lifts held-out greedy accuracy. Evaluation runs on a held-out split whose
prompts never appear in training.

Expected result (2-core CPU): see the quickstart row in docs/BENCHMARKS.md.
"""

from configs import common


def get_config(arg=None):
  del arg
  config = common.base_config()
  config.model.update(architecture="qwen3", hidden_size=64, intermediate_size=192,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=64)
  config.mesh.shape = dict(data=1, fsdp=-1, sequence=1, tensor=1)
  config.data.update(task="arithmetic", difficulty=0, eval_size=128, max_prompt_len=24)
  config.rollout.update(n=8, max_new_tokens=5, temperature=1.0)
  config.loss.update(preset="grpo", kl_beta=0.0)
  config.optim.update(lr=5e-4, grad_clip=1.0)
  config.sft.update(steps=250, lr=1e-3, batch_size=128)
  config.train.update(steps=200, batch_groups=32, minibatches=1, seed=0, eval_every=25,
                      checkpoint_every=20, keep=2)
  config.eval.pass_k = 0
  return config
