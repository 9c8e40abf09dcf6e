"""``epp sim``: an OpenAI-compatible simulated vLLM server for tests, load experiments and local demos.

:mod:`epp.sim.engine` models the engine (slots, FIFO queue, token timing, counters) without HTTP, with
:mod:`epp.sim.kvcache` (blocks and prefix caching), :mod:`epp.sim.latency` (TTFT / ITL model and
histograms), :mod:`epp.sim.lora` (adapter slots) and :mod:`epp.sim.tokens` (the stand-in tokenizer);
:mod:`epp.sim.server` is the aiohttp app; :mod:`epp.sim.cli` holds the flags and the entry point.
"""

from epp.sim.engine import Engine, SimConfig
from epp.sim.server import SimCluster, SimServer, build_app

__all__ = ["Engine", "SimCluster", "SimConfig", "SimServer", "build_app"]
