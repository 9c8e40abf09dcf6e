"""``llm_d_epp_request_error_total`` counts what reached the client: a routed request whose response
status is an error (read from the response headers), a 400 under the model its body named, and
the common codes of a model served at 0 from its first request on."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from epp import metrics
from epp.datalayer.store import EndpointStore
from epp.server.extproc import upstream_error_code
from tests.unit.extproc_harness import (
    BUFFERED,
    Harness,
    body_msg,
    endpoint,
    headers_msg,
    response_headers_msg,
    start,
)

NONE = 0


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    store = EndpointStore()
    for i in (1, 2):
        store.upsert(endpoint(i))
    h = await start(store)
    yield h
    await h.channel.close()
    await h.server.stop(0)


def _errors(model: str, code: str) -> float:
    return sum(
        child.value
        for values, child in metrics.REQUEST_ERROR_TOTAL._items()
        if values[0] == model and values[-1] == code
    )


def _series(model: str) -> set[str]:
    return {values[-1] for values, _ in metrics.REQUEST_ERROR_TOTAL._items() if values[0] == model}


@pytest.mark.parametrize(
    ("status", "code"),
    [(200, None), (304, None), (400, "BadRequest"), (429, "ResourceExhausted"), (500, "Internal"),
     (502, "ModelServerError"), (503, "ServiceUnavailable"), (504, "DeadlineExceeded"), (418, "BadRequest")],
)  # fmt: skip
def test_status_codes(status: int, code: str | None) -> None:
    assert upstream_error_code(status) == code


@pytest.mark.parametrize("mode", [BUFFERED, 2])  # BUFFERED; FULL_DUPLEX_STREAMED (2)
async def test_an_error_status_of_a_routed_request_counts_under_its_model(
    harness: Harness, mode: int
) -> None:
    model = f"errors-{mode}"
    body = f'{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}'.encode()
    before = _errors(model, "ServiceUnavailable")
    ok = [
        headers_msg({}, mode=mode, resp_mode=NONE),
        body_msg(body, True),
        response_headers_msg({":status": "200"}),
    ]
    await harness.exchange(ok, expect=3)
    assert _errors(model, "ServiceUnavailable") == before  # served at 0 from the first request on
    assert {"BadRequest", "ResourceExhausted", "Internal", "ServiceUnavailable"} <= _series(model)
    failed = [
        headers_msg({}, mode=mode, resp_mode=NONE),
        body_msg(body, True),
        response_headers_msg({":status": "503"}),
    ]
    await harness.exchange(failed, expect=3)
    assert _errors(model, "ServiceUnavailable") == before + 1


async def test_a_bad_request_counts_under_the_model_its_body_named(harness: Harness) -> None:
    before = _errors("named-model", "BadRequest")
    body = b'{"model":"named-model","messages":"not a list"}'
    out = await harness.exchange([headers_msg({}, mode=BUFFERED), body_msg(body, True)], expect=2)
    assert out[-1].immediate_response.status.code == 400
    assert _errors("named-model", "BadRequest") == before + 1
