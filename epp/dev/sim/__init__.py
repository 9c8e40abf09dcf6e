"""``epp sim``: an OpenAI-compatible simulated vLLM server for tests, load experiments and local demos.

``engine`` models the engine (with ``kvcache``, its vLLM block hashes ``block_hash``, ``latency``,
``lora``, ``tokens``: the real tokenizer of :mod:`epp.tokenization` and the generated text, and
``limits``: the context-length checks) without HTTP; request prompts become token ids in
:mod:`epp.tokenization.requests`; ``kv_events`` publishes vLLM's KV-cache events over ZMQ. The HTTP
side: ``openai`` (wire format), ``inference`` (the ``/v1`` endpoints), ``tokenize`` (vLLM's
tokenize, detokenize and render endpoints), ``generate`` (the token-in generate APIs of vLLM and
SGLang), ``metrics`` (``/metrics``), ``kv_admin`` (``/reset_prefix_cache`` and the
``/sim/kv-events`` hooks), ``context`` (what the handlers share), ``app`` (routes) and ``server``
(serving it); ``cli`` holds the flags and the entry point.
"""

from epp.dev.sim.app import build_app
from epp.dev.sim.engine import Engine, SimConfig
from epp.dev.sim.server import SimCluster, SimServer

__all__ = ["Engine", "SimCluster", "SimConfig", "SimServer", "build_app"]
