"""``epp sim``: an OpenAI-compatible simulated vLLM server for tests, load experiments and local demos.

``engine`` models the engine (with ``kvcache``, ``latency``, ``lora`` and the stand-in tokenizer
``tokens``) without HTTP; ``server`` is the aiohttp app; ``cli`` holds the flags and the entry point.
"""

from epp.dev.sim.engine import Engine, SimConfig
from epp.dev.sim.server import SimCluster, SimServer, build_app

__all__ = ["Engine", "SimCluster", "SimConfig", "SimServer", "build_app"]
