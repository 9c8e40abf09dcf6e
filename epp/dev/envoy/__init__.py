"""The Envoy in front of the EPP, for local runs and the checked-in deploy files.

``bootstrap`` generates Envoy bootstraps, ``reference`` the checked-in ones of ``deploy/envoy/``,
``command`` finds the Envoy binary and builds its command line, ``cli`` is ``python -m epp.dev.envoy``.
"""
