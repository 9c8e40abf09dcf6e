"""``epp pd-sidecar``: the decode-side reverse proxy of prefill/decode disaggregation.

It sits in front of the decode engine, reads the ``x-prefiller-host-port`` header the EPP sets, runs
the prefill on that endpoint with the configured KV connector's protocol (``nixlv2``: prefill first,
then decode with the returned ``kv_transfer_params``; ``sglang``: bootstrap fields sent to both at
once) and streams the decode engine's answer back. Everything else is passed through to the engine.
"""
