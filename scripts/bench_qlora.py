"""QLoRA memory: the frozen base's bytes per device in the memory plan, stored in float32,
bfloat16, int8 and int4 (``model.lora.quant``), from abstract shapes only (nothing is
computed, so any model size costs seconds).

Each row is ``memory.state_parts(abstract_state)`` of the run's RL state: ``policy`` is the
frozen base (the quantised projections' integer values, int4 at half a byte, plus their
float32 block scales; embeddings, norms and the LM head in ``model.param_dtype``),
``adapters`` the LoRA adapters.

Usage::

    python scripts/bench_qlora.py                        # the LoRA quickstart, block 16
    python scripts/bench_qlora.py --block 64 model.hidden_size=896 model.intermediate_size=4864 \
        model.num_layers=24 model.num_heads=14 model.num_kv_heads=2 model.head_dim=64
        # Qwen2.5-0.5B-shaped layers (the vocabulary is the quickstart tokenizer's)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl_jax import config_utils, train  # noqa: E402
from rl_jax.train import memory  # noqa: E402

ROWS = (("float32", "float32", ""), ("bfloat16", "bfloat16", ""), ("int8", "float32", "int8"),
        ("int4", "float32", "int4"))


def base_bytes(spec: str, overrides: list[str], block: int, dtype: str, quant: str) -> dict:
  """The memory plan's state parts of the RL state of ``spec`` + ``overrides`` with the base
  in ``dtype`` / ``quant``."""
  config = config_utils.load_config(spec, list(overrides) + [
      f"model.param_dtype={dtype}", f"model.lora.quant={quant}", f"model.lora.quant_block={block}",
      "mesh.num_devices=1", "sft.steps=0"])
  return memory.state_parts(train.abstract_state(train.build_setup(config)))


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", default="configs/quickstart.py:lora")
  ap.add_argument("--block", type=int, default=16, help="model.lora.quant_block")
  ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.hidden_size=896")
  args = ap.parse_args(argv)
  print(f"{args.config} {' '.join(args.overrides)} (block {args.block}); bytes per device")
  print(f"{'base':>9} {'policy':>14} {'vs float32':>10} {'adapters':>12}")
  ref = None
  for name, dtype, quant in ROWS:
    parts = base_bytes(args.config, args.overrides, args.block, dtype, quant)
    ref = ref or parts["policy"]
    print(f"{name:>9} {parts['policy']:>14,} {parts['policy'] / ref:>10.3f} "
          f"{parts['adapters']:>12,}")


if __name__ == "__main__":
  main()
