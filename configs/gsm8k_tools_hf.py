"""Multi-turn GRPO with a Python tool: a Qwen3 checkpoint solves GSM8K-format questions.

    python -m rl_jax.train --config=configs/gsm8k_tools_hf.py --workdir=/tmp/gsm8k_tools \\
        --config.model.hf_path=/models/Qwen3-0.6B --config.data.path=/data/gsm8k_train.jsonl \\
        --config.data.eval_path=/data/gsm8k_test.jsonl

The checkpoint directory holds config.json, *.safetensors, tokenizer.json and
tokenizer_config.json with its chat template (or chat_template.jinja); the data files are
JSONL (or Parquet) with ``question`` and ``answer`` ("... #### 72") fields (``env.name=
"math_tools"``, ``rl_jax.envs.tasks``). Each episode: the template renders the system prompt
(run Python with the ``python`` tool, put the final answer in \\boxed{}), the template's tool
list (the sandbox's JSON schema) and the question; the model calls
``<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>`` (the hermes format
the Qwen template writes; ``env.tool_format``), the sandbox (``rl_jax.envs.tools.
PythonSandbox``: fresh subprocess, 5 s, 512 MiB, no network) returns what the program prints
as a tool turn, and the episode ends at the first turn without a call: reward 1 when its
final answer equals the reference (math-verify), else 0. A turn ends at the template's end of
turn (``<|im_end|>``); the trained ids are the sampled ids and the appended observation ids.

Sizes for a 0.6B-1.7B Qwen3 on one accelerator (80 GB): G = 8 questions × M = 8 episodes,
at most 4 assistant turns of 512 tokens, 2048 tokens per trajectory after a prompt of at
most 512, tool outputs cut at 256 tokens; ``enable_thinking=False`` (Qwen3's non-thinking
mode: a reasoning block would not fit the turn budget; set it to None for the template's
default). GRPO (N = 8, ε = 0.2, β = 0.001 k3 KL), η = 1e-6, bf16 compute with float32
master weights, per-layer rematerialisation. No supervised warm start (the task has no
expert). The engine's programs are single-device (``mesh.num_devices=1``).

What to expect: every step's metrics.jsonl row holds ``reward_mean`` (training success at
temperature 1), ``turns_mean`` (about 2 when the model calls the tool once, then answers),
``tool_calls``, ``tool_errors`` and ``tool_errors_<kind>`` (malformed calls, Python
exceptions, time-outs); every 25 steps ``eval_accuracy`` (greedy success on the first 256
eval questions) and ``eval_turns_mean``; DIR/hf/ holds the final policy. No measured
success rates yet: tests/test_agent_hf.py runs this config end to end on a tiny random
Qwen3-shaped checkpoint only.
"""

from rl_jax import config as base


def get_config(arg=None):
  del arg
  config = base.base_config()
  config.model.update(dtype="bfloat16", param_dtype="float32", remat="full")
  config.mesh.num_devices = 1  # the multi-turn engine's programs are single-device
  config.env.update(name="math_tools", max_turns=4, max_total_tokens=2048,
                    max_turn_tokens=512, max_obs_tokens=256, workers=16, step_timeout_s=30.0,
                    python_timeout_s=5.0, max_tool_calls=2, tool_format="auto",
                    enable_thinking=False)
  config.data.update(format="gsm8k", max_prompt_len=512, eval_size=256)
  config.rollout.update(n=8, temperature=1.0)
  config.loss.update(preset="grpo", kl_beta=0.001)
  config.optim.update(lr=1e-6, grad_clip=1.0, warmup_steps=10)
  config.sft.steps = 0
  config.train.update(steps=300, batch_groups=8, minibatches=4, eval_every=25,
                      checkpoint_every=25, keep=3)
  config.log.tensorboard = True
  return config
