"""``python -m rl_jax.train``: see ``rl_jax.train.loop.main``."""

from rl_jax.train.loop import main

if __name__ == "__main__":
  main()
