"""MoE quickstart: the quickstart's digit-sorting task with a tiny Qwen3-MoE-shaped policy.

    python -m rl_jax.train --config=configs/moe_quickstart.py --workdir=/tmp/rl_jax_moe
    python -m rl_jax.train --config=configs/moe_quickstart.py --workdir=/tmp/rl_jax_moe_replay \\
        --config.model.router_replay=True

Model: 2 layers, both mixtures of E = 8 SwiGLU experts of width 48 with the top X = 2 per
token (softmax router, weights renormalised over the chosen two), qwen3 attention (q/k
norms); the rest as configs/quickstart.py. ``model.router_replay=True`` makes the training
passes (update, proximal and reference log-probs) use the experts the sampler chose for
each response token; the prompt tokens are routed by the trainer's router. Metric
``routing_mismatch``: fraction of response tokens whose expert set differs between sampler
and trainer (0 with replay by construction).

Stages and hyperparameters as configs/quickstart.py except the RL length: 25 supervised
steps, then 300 GRPO steps (ε = 0.2, N = 8 samples at temperature 0.5, 32 prompts per step,
β = 0, η = 2e-4). 250 GRPO steps ended at 0.918 (+28 points); η = 3e-4 for 250 steps at
0.889 (faster early, noisier late).

Expected result (2-core AMD EPYC CPU with AVX-512, quiet, JAX 0.10.2, measured): about 35
seconds; held-out greedy accuracy 0.638 after the supervised stage (step 25) -> 0.947 at the
end (step 325; +31 points; 0.957 at step 300), pass@4 0.087 -> 0.947, training reward 0.03 ->
0.91 (0.966 before the CPU default ``model.prefix_attention=auto``);
``routing_mismatch`` 0 at every step. With ``model.router_replay=True`` the same numbers and
bit-identical final weights (float32: sampler and trainer already choose the same experts).
Table and the bfloat16 mismatch benchmark: docs/BENCHMARKS.md ("Mixture of experts").

Expert parallelism with a capacity (8 fake devices, one expert per device on the fsdp axis)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m rl_jax.train \
        --config=configs/moe_quickstart.py --workdir=/tmp/rl_jax_moe_ep \
        --config.mesh.num_devices=8 --config.model.moe_capacity_factor=2.0

``model.moe_capacity_factor`` (0 = dropless, the default): each device sends at most
C = ceil(factor · tokens · X / E) assignments to each expert by all-to-all, earlier tokens
first; the rest are dropped, metric ``moe_dropped_tokens`` (fraction of assignments, mean
over the MoE layers). Measured (2-core CPU, shared): factor 2.0 0.628 -> 0.986 (+36 points),
with router replay 0.628 -> 0.961, about 5% of the assignments dropped at the end; factor
1.25 drops about 20% and ends at +26 to +28 points; dropless on 8 devices 0.638 -> 0.937.
"""

from rl_jax import config as base


def get_config(arg=None):
  del arg
  config = base.base_config()
  config.model.update(architecture="qwen3_moe", hidden_size=64, intermediate_size=192,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=64, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=48, norm_topk_prob=True, moe_every=1)
  config.mesh.shape = dict(data=1, fsdp=-1, sequence=1, tensor=1)
  config.data.update(task="sorting", difficulty=0, eval_size=256, max_prompt_len=24)
  config.rollout.update(n=8, max_new_tokens=5, temperature=0.5)
  config.loss.update(preset="grpo", kl_beta=0.0)
  config.optim.update(lr=2e-4, grad_clip=1.0)
  config.sft.update(steps=25, lr=1e-3, batch_size=128)
  config.train.update(steps=300, batch_groups=32, minibatches=1, seed=0, eval_every=25,
                      checkpoint_every=20, keep=2)
  config.train.old_logp_pass = "separate"
  config.eval.pass_k = 4
  return config
