"""A streamed response reaches the client token by token through Envoy and the EPP, whatever the
ext_proc response exchange: every token is forwarded as the engine sends it, none held until the end.

Real Envoy, EPP and ``epp sim`` (slow tokens: 400 ms apart). Without the response headers
(``response_header_mode: SKIP``) the EPP must tell a stream from the request itself; when it did
not, it held the whole body until its end and the client got its first token with the last one.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator

import pytest

from tests.integration.harness import JSON_HEADERS, Envoy, Rig, chat_body, marker, require_envoy

pytestmark = pytest.mark.integration

TOKENS = 5
ITL_MS = 400  # between two tokens; the stream lasts (TOKENS - 1) x this after the first
SIM_ARGS = ("--time-to-first-token", "0", "--inter-token-latency", str(ITL_MS), "--max-tokens", str(TOKENS))


@pytest.fixture
def envoys(rig: Rig) -> Iterator[dict[str, Envoy]]:
    require_envoy()
    sims = rig.start_sims(1, extra=SIM_ARGS)
    epp = rig.start_epp(sims)
    yield {
        mode: rig.start_envoy(
            epp,
            body_mode="FULL_DUPLEX_STREAMED",
            response_body_mode="FULL_DUPLEX_STREAMED",
            response_header_mode=mode,
            name=f"envoy-{mode.lower()}",
        )
        for mode in ("SEND", "SKIP")
    }


def _data_line_times(envoy: Envoy) -> list[float]:
    """Send one streaming chat request; the arrival time of each SSE data line, from the send."""
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=30)
    try:
        t0 = time.monotonic()
        conn.request("POST", "/v1/chat/completions", chat_body(marker(), stream=True), JSON_HEADERS)
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        times = []
        while line := resp.readline():
            if line.startswith(b"data:"):
                times.append(time.monotonic() - t0)
        return times
    finally:
        conn.close()


def test_tokens_reach_the_client_as_they_are_generated(envoys: dict[str, Envoy]) -> None:
    # The engine spends (TOKENS - 1) x ITL_MS = 1.6 s between the first and the last token; a held
    # body arrives at once (spread about 0). Half of it leaves room for a loaded machine.
    for header_mode, envoy in envoys.items():
        times = _data_line_times(envoy)
        assert len(times) >= TOKENS, (header_mode, times)  # one data line per token, then [DONE]
        spread = times[-1] - times[0]
        assert spread > (TOKENS - 1) * ITL_MS / 1000 / 2, (
            f"response headers {header_mode}: data lines at {times} s, the first token was held"
        )
