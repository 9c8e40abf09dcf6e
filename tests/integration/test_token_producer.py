"""``token-producer`` end to end: the real Envoy, the real ``epp serve`` and simulators, with the
``vllm`` backend rendering through an HTTP render server on 127.0.0.1 (answering like vLLM's
``/v1/chat/completions/render``).

The rendered token count (10 ids) drives ``context-length-aware`` filtering to the short-context
endpoint, where the EPP's byte estimate of the same 4000-byte prompt (1000 tokens) would pick the
long-context one; an identical prompt is answered from the render cache; with the render server
gone requests are still served (by the estimate) and the failures are counted.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import yaml

from tests.integration.harness import MODEL, Rig

pytestmark = pytest.mark.integration

LABEL = "llm-d.ai/context-length-range"
RENDERED_IDS = list(range(100, 110))


class _Render(BaseHTTPRequestHandler):
    calls: list[tuple[str, dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
        type(self).calls.append((self.path, body))
        one = {"request_id": "r", "token_ids": RENDERED_IDS, "features": None, "model": body.get("model")}
        data = json.dumps([one] if self.path == "/v1/completions/render" else one).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return


@pytest.fixture
def render_server() -> Iterator[ThreadingHTTPServer]:
    _Render.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Render)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _config(url: str) -> dict[str, Any]:
    return dict(
        yaml.safe_load(
            f"""
plugins:
- {{type: token-producer, parameters: {{modelName: base/model, vllm: {{url: "{url}", timeout: 2s}}}}}}
- {{type: context-length-aware, parameters: {{enableFiltering: true}}}}
- {{type: max-score-picker}}
schedulingProfiles:
- {{name: default, plugins: [{{pluginRef: context-length-aware}}, {{pluginRef: max-score-picker}}]}}
"""
        )
    )


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = ",".join(sorted(line[len(name) + 1 : line.index("}")].split(",")))
            if got == want:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_rendered_tokens_route_and_failures_fall_back(rig: Rig, render_server: ThreadingHTTPServer) -> None:
    short, long = rig.start_sims(2)
    labels = {short.name: {LABEL: "0-100"}, long.name: {LABEL: "101-1000000"}}
    url = f"http://127.0.0.1:{render_server.server_address[1]}"
    epp = rig.start_epp([short, long], config=_config(url), labels=labels)
    envoy = rig.start_envoy(epp)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 4000}]}).encode()

    # 1. Rendered: 10 tokens -> the short-context endpoint; the render request is vLLM's.
    resp = envoy.post("/v1/chat/completions", body)
    assert resp.status == 200, resp
    assert resp.port == short.port
    path, sent = _Render.calls[-1]
    assert path == "/v1/chat/completions/render"
    assert sent["model"] == "base/model" and sent["messages"][0]["content"] == "x" * 4000

    # 2. The same prompt again: routed the same way, from the render cache (no second call).
    calls = len(_Render.calls)
    resp = envoy.post("/v1/chat/completions", body)
    assert resp.status == 200 and resp.port == short.port
    assert len(_Render.calls) == calls
    text = epp.metrics()
    assert (
        _metric(
            text, "llm_d_epp_token_producer_render_cache_total", plugin_name="token-producer", result="hit"
        )
        >= 1
    )

    # 3. The render server is gone: still served, by the estimate (1000 tokens -> long), counted.
    render_server.shutdown()
    render_server.server_close()
    other = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "y" * 4000}]}).encode()
    resp = envoy.post("/v1/chat/completions", other)
    assert resp.status == 200, resp
    assert resp.port == long.port
    text = epp.metrics()
    assert (
        _metric(
            text,
            "llm_d_epp_token_producer_render_failures_total",
            plugin_name="token-producer",
            reason="connect",
        )
        >= 1
    )
