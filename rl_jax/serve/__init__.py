"""An OpenAI-compatible HTTP server over the rollout engine: ``python -m rl_jax.serve``.

::

    pip install -e ".[serve]"
    python -m rl_jax.serve --model=runs/quickstart/hf --port=8000
    # then any OpenAI client: base_url="http://127.0.0.1:8000/v1"

Modules: ``checkpoint`` (what a directory serves), ``scheduler`` (continuous batching of
concurrent requests on the paged-KV engine), ``protocol`` (request and error bodies),
``scoring`` (``top_logprobs``), ``app`` (the FastAPI routes). Nothing here is imported by
``import rl_jax``; the server's libraries come with the ``serve`` extra.
"""

__all__: list[str] = []  # the modules are the API (``rl_jax.serve.app.create_app``, ...)
