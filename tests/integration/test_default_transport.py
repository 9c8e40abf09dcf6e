"""`epp serve` and `epp envoy-config` with their defaults connect: a real EPP serving TLS (its
default, a self-signed certificate) behind a real Envoy on the bootstrap the generator prints."""

from __future__ import annotations

import contextlib
import io

import pytest
import yaml

from epp.dev import stack
from epp.dev.envoy import cli as envoy_cli
from tests.integration.harness import Envoy, Rig, chat_body, marker

pytestmark = pytest.mark.integration


def test_epp_serve_and_envoy_config_defaults_connect(rig: Rig) -> None:
    sims = rig.start_sims(1)
    epp = rig.start_epp(sims, extra=["--secure-serving=true"])  # serve's own default (the stack's is off)
    port, admin = stack.free_port(), stack.free_port()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        args = ["--extproc-port", str(epp.grpc_port), "--listen-port", str(port), "--admin-port", str(admin)]
        assert envoy_cli.main(args) == 0
    child = rig.stack.start_envoy("envoy-defaults", yaml.safe_load(out.getvalue()), concurrency=1)
    rig.stack.wait_envoy(child, admin)
    envoy = Envoy(child, port, admin, "BUFFERED", False)
    resp = envoy.post("/v1/chat/completions", chat_body(marker()))
    assert resp.status == 200, resp
