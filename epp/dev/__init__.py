"""Developer tooling around the EPP, not used by ``epp serve``.

``sim`` is the simulated vLLM server (``epp sim``), ``stack`` the local stack of simulators, EPP and
Envoy (``epp run``, the benchmarks, the integration tests), ``envoy`` the Envoy bootstrap generator.
"""
