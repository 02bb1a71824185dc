"""rl_jax: JAX/TPU-first RL post-training of language models."""

from setuptools import find_packages, setup

_TPU = ["libtpu==0.0.42.1; sys_platform == 'linux'"]  # the version jax[tpu]==0.10.2 pulls

setup(
    name="rl_jax",
    version="0.1.0",
    description="Exact, fast RL post-training (GRPO family, VCPO, PPO) for language models in JAX",
    packages=find_packages(include=["rl_jax", "rl_jax.*", "pallas_kernels", "pallas_kernels.*"]),
    python_requires=">=3.10",
    install_requires=[
        # Tested with jax 0.10.2 (rl_jax.version.TESTED_JAX; `python -m rl_jax.version` prints
        # the versions in use). No upper bound: no known break in a newer release; the Pallas
        # kernels use jax.experimental APIs, the likeliest to need an update.
        "jax>=0.10.2",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11",
        "ml-collections>=1.0",
        "absl-py",
        "tensorflow-datasets>=4.9.9",
        "array_record",  # the file format of the TFDS data source (read by tensorflow-datasets)
        "etils",
        "safetensors>=0.4",
        "tokenizers>=0.20",
        "math-verify>=0.8",
        "tqdm",
        "matplotlib",
        "tensorboardX",
        "numpy",
        "jinja2>=3.1",  # chat templates of multi-turn (agentic) runs, imported by the trainer
        # QLoRA's quantised base (model.lora.quant; rl_jax.models.quant imports it on first
        # use). Pinned: its QArray is what the checkpoints of a quantised base hold.
        "qwix==0.1.8",
    ],
    extras_require={
        # rl_jax.envs adapters for gymnasium and verifiers environments.
        "agent": ["gymnasium>=1.0", "verifiers==0.4.0"],
        # gs:// workdirs and data files (rl_jax.storage; etils.epath reads them with gcsfs).
        "gcs": ["gcsfs"],
        # loading the exported LoRA adapters (DIR/hf_adapter) onto transformers models.
        "lora": ["peft>=0.13"],
        # python -m rl_jax.serve: the OpenAI-compatible HTTP server (rl_jax.serve).
        "serve": ["fastapi>=0.110", "uvicorn>=0.29", "pydantic>=2"],
        # the TPU compiler, for the topology dry run on any host
        # (--config.train.dry_run=True --config.dry_run.topology=v5e:2x2, rl_jax.train.topology)
        # and for TPU VMs; pinned to the libtpu that jax[tpu]==0.10.2 installs.
        "tpu": _TPU,
        "test": [
            *_TPU,  # tests/test_tpu_compile.py compiles for TPU topologies on the CPU host
            "gymnasium>=1.0",
            "verifiers==0.4.0",
            "pytest",
            "chex>=0.1.90",
            "pytest-xdist",
            "pytest-timeout",  # pytest.ini: a hung test is stopped with its stacks
            "hypothesis",
            "transformers>=4.50",
            "peft>=0.13",  # the LoRA export's parity test
            # Pinned for the parity tests. On Linux from PyPI this is the CUDA build (GBs); for a
            # CPU-only machine install torch from https://download.pytorch.org/whl/cpu first.
            "torch==2.13.0",
            # tests/test_notebook.py runs notebooks/quickstart.ipynb in a Jupyter kernel.
            "nbclient",
            "nbformat",
            "ipykernel",
            # tests/test_serve.py: the server, and the openai client against it.
            "fastapi>=0.110",
            "uvicorn>=0.29",
            "openai>=1.50",
            "httpx",
            # tests/test_workdir_gcs.py: a gs:// workdir against a local emulator.
            "gcsfs",
            "gcp-storage-emulator",
        ],
    },
)
