"""Client-chosen model names cannot grow the EPP's /metrics: the real ``epp serve`` over a sim,
driven over gRPC on its ext_proc port like Envoy drives it."""

from __future__ import annotations

import asyncio
import json
import re
import time

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from tests.integration.harness import MODEL, Rig
from tests.unit.extproc_harness import body_msg, headers_msg

pytestmark = pytest.mark.integration

JUNK = 3000
_MODEL_LABEL = re.compile(r'^inference_objective_request_total\{model_name="([^"]*)"', re.M)


async def _route(stub: ep_grpc.ExternalProcessorStub, model: str) -> ep.ProcessingResponse:
    call = stub.Process()
    await call.write(headers_msg({}))
    await call.write(
        body_msg(json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode(), True)
    )
    first = await call.read()
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass
    assert first is not grpc.aio.EOF
    return first


async def _flood(port: int, served_every: int) -> int:
    """JUNK distinct model names, one served request every ``served_every``; the served count."""
    served = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        for i in range(JUNK):
            reply = await _route(stub, f"junk-{i}")
            assert reply.HasField("request_headers"), reply  # routed, not rejected
            if i % served_every == 0:
                await _route(stub, MODEL)
                served += 1
    return served


def _request_totals(text: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = _MODEL_LABEL.match(line)
        if m:
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


_MODEL_LABELS = re.compile(r'[{,](model_name|target_model_name|target_model)="')


def _model_series(text: str) -> list[str]:
    """The page's series that carry a model-name label (sample lines without their values): the
    series a client's choice of model name could multiply."""
    return sorted(
        line.rsplit(" ", 1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#") and _MODEL_LABELS.search(line)
    )


def _overflow(text: str) -> float:
    m = re.search(r'^llm_d_epp_metric_label_overflow_total\{label="model_name"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def _probe(port: int, model: str) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await _route(ep_grpc.ExternalProcessorStub(channel), model)


def test_distinct_model_names_do_not_grow_metrics(rig: Rig) -> None:
    sims = rig.start_sims(1)
    epp = rig.start_epp(sims)
    # Until the sim has been scraped nothing is known to be served and names are admitted (up to
    # the cap); once its model is known, an unserved probe name records as "other".
    for i in range(300):
        asyncio.run(_probe(epp.grpc_port, f"probe-{i}"))
        if _overflow(epp.metrics()) > 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail("unserved model names never recorded as 'other'")
    # The served model's series exist before the page is measured (with the current and the
    # deprecated request histograms one new series is ~15 KB), so only junk names could grow it.
    asyncio.run(_probe(epp.grpc_port, MODEL))
    before = epp.metrics()
    served = asyncio.run(_flood(epp.grpc_port, served_every=100))
    text = epp.metrics()
    totals = _request_totals(text)
    assert not [m for m in totals if m.startswith("junk-")], "unserved names got their own series"
    assert totals.get(MODEL) == _request_totals(before).get(MODEL, 0) + served  # its own label
    assert totals.get("other", 0) - _request_totals(before).get("other", 0) == JUNK
    assert _overflow(text) - _overflow(before) >= JUNK
    assert len(text) < len(before) + 10_000, (len(before), len(text))  # 3000 names: ~20 MB before the fix
    # Not one model-labelled series more: the junk names only count up the "other" series. (How
    # many probe names were admitted before the model was known depends on timing, so the page's
    # own size is not a fixed number; series without a model label, e.g. pool gauges, may appear
    # with the scrapes meanwhile.)
    series = _model_series(before)
    assert len(series) > 10, series  # the served model's and "other"'s series are on the page
    assert _model_series(text) == series
