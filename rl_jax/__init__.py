"""rl_jax: exact, fast reinforcement-learning post-training of language models in JAX.

Axis letters: the one legend for shapes in docstrings, comments and einsums across the
package (every other module refers here; no letter means two things)::

  B batch rows                         L layers
  T tokens of a row (query length;     D model width
    P + R in training rows)            F ffw (MLP) width
  S kv (key/value) length              V vocab
  G groups (prompts) of a step         N query heads
  M samples per prompt (group size)    K kv heads
  P prompt (context) length            H head dim
  R response length (new tokens)       J query heads per kv head (N = K·J)
  C reward components                  Q queued batches (asynchronous runner)
  W chunks of a step (adaptive group size: row groups of one prompt each)
  Z most chunks of one prompt          I training examples (prompts in the train split)
  U turns of a multi-turn trajectory (the most turns of any row)
  E experts (mixture of experts)       X experts chosen per token (top-k)
  Y layers with experts (Y <= L)

Lower case marks a size local to one formula: m samples per chunk (adaptive group size),
k_i chunks of prompt i. A prime marks a padded length (R', P'); products are written with
a dot (G·M rows). Sizes that are not axes of a batch are named by the argument that sets
them (``[capacity]``, ``[batch_size]``).
"""

__version__ = "0.1.0"
