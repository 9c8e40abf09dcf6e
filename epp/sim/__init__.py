"""``epp sim``: a small OpenAI-compatible simulated vLLM server for tests and local demos.

:mod:`epp.sim.engine` models the engine (slots, FIFO queue, token timing, counters) without HTTP;
:mod:`epp.sim.server` is the aiohttp app; :mod:`epp.sim.cli` holds the flags and the entry point.
"""

from epp.sim.engine import Engine, SimConfig
from epp.sim.server import SimServer, build_app

__all__ = ["Engine", "SimConfig", "SimServer", "build_app"]
