"""Orbax save/restore of the whole train state, onto any mesh.

The train state is any pytree whose leaves are ``jax.Array`` (sharded or not, including
typed PRNG keys from ``jax.random.key`` and raw ``uint32`` keys), numpy arrays or Python
numbers: parameters, optax states (NamedTuples), the step, the data position and sampler
state. A small JSON-able ``metadata`` dict travels with it (config, data cursor, versions).

Layout of ``directory``::

    <directory>/<step>/state/      arrays (orbax/tensorstore: OCDBT locally, zarr per array on gs://)
                       metadata/   the user's JSON dict
                       manifest/   path -> shape/dtype of every leaf, checked on restore
                       commit_success.txt
                       checksums.json  every file's size and sha256, written once the save
                                       is complete and checked on restore (``integrity``)

Which steps exist is decided in one place, orbax's step bookkeeping: a step is a directory
named ``<step>`` (orbax's standard step name) that holds orbax's ``commit_success.txt``
marker (``STEP_NAMES``). ``Checkpointer`` gives that definition to its
``orbax.checkpoint.CheckpointManager``, which tracks the saved steps, decides ``should_save``
from ``save_every``, deletes all but the newest ``keep`` and cleans up unfinished saves;
the module-level ``all_steps``/``latest_step``/``restore`` ask the same definition about the
directory on disk (for a reader that holds no ``Checkpointer``).

Atomicity: orbax writes a step into ``<step>.orbax-checkpoint-tmp-<n>/`` and renames it to
``<step>/`` only after every file, the ``commit_success.txt`` marker included, is written.
So a crash mid-save leaves nothing that ``latest_step``/``restore`` would pick up (the
stray tmp directory is deleted when the next ``Checkpointer`` opens the directory), and a
``<step>/`` without the marker (a half-copied run) is ignored too.

The pytree is stored as a nested dict keyed by the leaves' key paths (``params/w``,
``opt_state/0/mu/w``), so any registered pytree (NamedTuple, dataclass, flax State) works
and restore rebuilds the target's own tree type.

Restore takes an *abstract* target: a pytree matching the saved one, whose leaves say what
to build. Typically::

    abstract = jax.eval_shape(init_fn, rng)            # ShapeDtypeStructs
    shardings = sharding.logical_to_sharding(axes, mesh, rules, abstract)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
    state, metadata = ckpt.restore(abstract)

Leaves of the target:
  ``jax.ShapeDtypeStruct``  restored as a jax.Array with that dtype and ``.sharding``
                            (no sharding: on the first local device); any mesh works.
  ``jax.Array``             as its ShapeDtypeStruct (same shape, dtype, sharding).
  ``np.ndarray``            restored as numpy with that dtype.
  ``int``/``float``/``bool`` restored as that Python type.
Shapes and the tree's key paths must match the checkpoint exactly, and a typed key must
restore into a typed key; other dtypes are cast (e.g. float32 weights into bfloat16).
"""

from rl_jax.checkpoint.manager import (STEP_NAMES, Checkpointer, all_steps, latest_step,
                                       read_metadata, restore, saved_leaves)
from rl_jax.checkpoint.tree import leaf_paths

__all__ = ["Checkpointer", "latest_step", "all_steps", "restore", "read_metadata", "STEP_NAMES",
           "leaf_paths", "saved_leaves"]
