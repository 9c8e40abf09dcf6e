"""``epp sim``: an OpenAI-compatible simulated vLLM server for tests, load experiments and local demos.

``engine`` models the engine (with ``kvcache``, ``latency``, ``lora`` and ``tokens``: the real
tokenizer of :mod:`epp.tokenization` and the generated text) without HTTP; ``prompts`` turns request
prompts into token ids. The HTTP side: ``openai`` (wire format), ``inference`` (the ``/v1``
endpoints), ``tokenize`` (vLLM's tokenize, detokenize and render endpoints), ``metrics``
(``/metrics``), ``context`` (what the handlers share), ``app`` (routes) and ``server`` (serving it);
``cli`` holds the flags and the entry point.
"""

from epp.dev.sim.app import build_app
from epp.dev.sim.engine import Engine, SimConfig
from epp.dev.sim.server import SimCluster, SimServer

__all__ = ["Engine", "SimCluster", "SimConfig", "SimServer", "build_app"]
