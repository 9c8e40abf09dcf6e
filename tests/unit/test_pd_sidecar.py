"""The P/D sidecar: header parsing, the SSRF allow-list, the nixlv2 and sglang flows, fallbacks.

In-process simulators (prefill and decode roles) and the sidecar app on free ports of 127.0.0.1;
a few tiny aiohttp servers play a prefiller that answers garbage, errors or never.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client import generate_latest

from epp.dev.sim.engine import SimConfig
from epp.dev.sim.server import SimServer
from epp.framework import EndpointMetadata
from epp.sidecar import connectors
from epp.sidecar.allowlist import AllowList, from_file, from_pool
from epp.sidecar.cli import add_arguments, config_of, pool_of
from epp.sidecar.proxy import Sidecar, SidecarConfig
from epp.sidecar.target import PREFILL_HEADER, Target, TargetError, choose, parse_header, parse_target
from tests.fakekube import FakeKube, objects
from tests.unit.polling import until

# --------------------------------------------------------------------------------------- header


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.1:8000", Target("10.0.0.1", 8000)),
        (" 10.0.0.1:8000 ", Target("10.0.0.1", 8000)),
        ("[fd00::1]:8000", Target("fd00::1", 8000)),
        ("prefill-0.pool.svc:9000", Target("prefill-0.pool.svc", 9000)),
    ],
)
def test_parse_target(text: str, expected: Target) -> None:
    assert parse_target(text) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("10.0.0.1", "expected host:port"),
        (":8000", "expected host:port"),
        ("10.0.0.1:0", "port must be"),
        ("10.0.0.1:70000", "port must be"),
        ("10.0.0.1:http", "port must be"),
        ("fd00::1:8000", "IPv6 endpoint is written"),
        ("[fd00::1]8000", "IPv6 endpoint is written"),
        ("[nothex]:8000", "not an IPv6 address"),
        ("bad_host!:8000", "neither an IPv4 address nor a host name"),
        ("http://10.0.0.1:8000", "not a URL"),
        ("user@10.0.0.1:8000", "not a URL"),
    ],
)
def test_parse_target_rejects(text: str, why: str) -> None:
    with pytest.raises(TargetError, match=why):
        parse_target(text)


def test_parse_header_lists_and_blank() -> None:
    assert parse_header([]) == []
    assert parse_header([" "]) == []
    assert parse_header(["10.0.0.1:1, 10.0.0.2:2"]) == [Target("10.0.0.1", 1), Target("10.0.0.2", 2)]
    assert parse_header(["10.0.0.1:1", "10.0.0.2:2"]) == [Target("10.0.0.1", 1), Target("10.0.0.2", 2)]
    with pytest.raises(TargetError, match="empty prefill endpoint"):
        parse_header(["10.0.0.1:1,,10.0.0.2:2"])
    with pytest.raises(TargetError, match="at most"):
        parse_header([",".join(f"10.0.0.1:{p}" for p in range(1, 100))])


def test_choose_first_unless_sampling() -> None:
    targets = [Target("10.0.0.1", 1), Target("10.0.0.2", 2), Target("10.0.0.3", 3)]
    rng = random.Random(1)
    assert {choose(targets, sample=False, rng=rng) for _ in range(20)} == {targets[0]}
    assert len({choose(targets, sample=True, rng=rng) for _ in range(60)}) == 3


# ------------------------------------------------------------------------------------ allow-list


def meta(name: str, address: str, port: int, role: str | None = None) -> EndpointMetadata:
    return EndpointMetadata(name, address, port, labels={"llm-d.ai/role": role} if role else {})


def test_allow_list_admits_the_pool_prefill_endpoints_only() -> None:
    allow = AllowList()
    allow.upsert(meta("p", "10.0.0.1", 8000, "prefill"))
    allow.upsert(meta("both", "10.0.0.2", 8000, "both"))
    allow.upsert(meta("unlabelled", "10.0.0.3", 8000))
    allow.upsert(meta("d", "10.0.0.4", 8000, "decode"))
    allow.upsert(meta("v6", "fd00::1", 8000, "prefill"))
    assert allow.allows(Target("10.0.0.1", 8000))
    assert allow.allows(Target("10.0.0.2", 8000))
    assert not allow.allows(Target("10.0.0.3", 8000)), "prefill-filter drops an unlabelled endpoint"
    assert allow.allows(Target("fd00::1", 8000))
    assert not allow.allows(Target("10.0.0.4", 8000)), "a decode-only endpoint is no prefiller"
    assert not allow.allows(Target("10.0.0.1", 22)), "the pool's port only"
    assert not allow.allows(Target("169.254.169.254", 80))
    allow.delete("default/p")
    assert not allow.allows(Target("10.0.0.1", 8000)), "a pod that left the pool is refused"
    allow.upsert(meta("both", "10.0.0.2", 8000, "decode"))  # relabelled
    assert not allow.allows(Target("10.0.0.2", 8000))


async def test_allow_list_from_endpoints_file(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text(
        "endpoints:\n"
        "- {name: p, address: 127.0.0.1, port: 9001, labels: {llm-d.ai/role: prefill}}\n"
        "- {name: d, address: 127.0.0.1, port: 9002, labels: {llm-d.ai/role: decode}}\n"
    )
    allow = AllowList()
    source = await from_file(allow, str(path))
    try:
        assert allow.ready and allow.hostports == {"127.0.0.1:9001"}
    finally:
        await source.stop()


async def test_allow_list_from_the_inference_pool(kube: FakeKube, tmp_path: Path) -> None:
    """Through the (fake) API server: the pool's ready prefill pods, followed as they change."""
    kubeconfig = str(kube.write_kubeconfig(tmp_path / "kubeconfig"))
    allow = AllowList()
    source = await from_pool(allow, "ns", "pool", kubeconfig)
    try:
        await asyncio.sleep(0.3)
        assert not allow.ready, "no pool yet"
        kube.create(objects.inference_pool("ns", (8000,), name="pool"))
        kube.create(objects.pod("ns", "p", "10.0.0.1", labels={"app": "vllm", "llm-d.ai/role": "prefill"}))
        kube.create(objects.pod("ns", "d", "10.0.0.2", labels={"app": "vllm", "llm-d.ai/role": "decode"}))
        kube.create(objects.pod("ns", "x", "10.0.0.3", labels={"app": "other", "llm-d.ai/role": "prefill"}))
        await until(
            lambda: allow.ready and allow.hostports == {"10.0.0.1:8000"}, 10.0, lambda: str(allow.hostports)
        )
        kube.create(objects.pod("ns", "p2", "10.0.0.4", labels={"app": "vllm", "llm-d.ai/role": "prefill"}))
        await until(lambda: "10.0.0.4:8000" in allow.hostports, 10.0, lambda: str(allow.hostports))
        kube.delete("v1", "Pod", "ns", "p")
        await until(lambda: allow.hostports == {"10.0.0.4:8000"}, 10.0, lambda: str(allow.hostports))
    finally:
        await source.stop()


def test_pool_from_flag_and_environment(tmp_path: Path) -> None:
    none = str(tmp_path / "absent")
    assert pool_of("", {}, none) == ("", "")
    assert pool_of("ns/pool", {}, none) == ("ns", "pool")
    assert pool_of("pool", {"INFERENCE_POOL_NAMESPACE": "a"}, none) == ("a", "pool")
    env = {"INFERENCE_POOL_NAME": "p2", "INFERENCE_POOL_NAMESPACE": "b"}
    assert pool_of("", env, none) == ("b", "p2")
    assert pool_of("", {"INFERENCE_POOL_NAME": "p3"}, none) == ("default", "p3")
    ns_file = tmp_path / "namespace"
    ns_file.write_text("mine\n")
    assert pool_of("p4", {}, str(ns_file)) == ("mine", "p4")


def test_flags_under_the_reference_names() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--port", "8000", "--vllm-port", "8200", "--connector", "sglang", "--enable-ssrf-protection"]
    )
    config = config_of(args)
    assert (config.port, config.decoder_url, config.connector) == (8000, "http://127.0.0.1:8200", "sglang")
    assert args.enable_ssrf_protection is True
    args = parser.parse_args(
        ["--model-server-port", "9", "--kv-connector", "nixlv2", "--enable-ssrf-protection=false"]
    )
    assert (config_of(args).decoder_url, args.enable_ssrf_protection) == ("http://127.0.0.1:9", False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--connector", "lmcache-unknown"])


# ------------------------------------------------------------------------------------ the flows

FAST = {"time_scale": 0.0, "port": 0, "host": "127.0.0.1"}


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"127.0.0.1:{port}"


Stack = Callable[..., Awaitable[tuple[Sidecar, str]]]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def sims() -> AsyncIterator[tuple[SimServer, SimServer]]:
    prefill = SimServer(SimConfig(**FAST, role="prefill", name="prefill-0"))
    decode = SimServer(SimConfig(**FAST, role="decode", name="decode-0"))
    await prefill.start()
    await decode.start()
    yield prefill, decode
    await prefill.stop()
    await decode.stop()


@pytest.fixture
async def sidecar_for() -> AsyncIterator[Stack]:
    runners: list[web.AppRunner] = []

    async def start(decode_url: str, **options: Any) -> tuple[Sidecar, str]:
        allow = options.pop("allow", None)
        sidecar = Sidecar(SidecarConfig(decoder_url=decode_url, **options), allow=allow)
        runner, address = await serve(sidecar.app())
        runners.append(runner)
        return sidecar, f"http://{address}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def journal(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with session.get(f"{url}/debug/requests") as resp:
        entries: list[dict[str, Any]] = await resp.json()
        return entries


def sample(sidecar: Sidecar, name: str, **labels: str) -> float:
    value = sidecar.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def body(text: str = "hello there general kenobi", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


async def test_nixl_prefills_then_decodes_with_the_transfer_params(
    session: aiohttp.ClientSession, sims: tuple[SimServer, SimServer], sidecar_for: Stack
) -> None:
    prefill, decode = sims
    sidecar, url = await sidecar_for(decode.url)
    target = f"127.0.0.1:{prefill.port}"
    for stream in (False, True):
        async with session.post(
            f"{url}/v1/chat/completions", json=body(stream=stream), headers={PREFILL_HEADER: target}
        ) as resp:
            assert resp.status == 200
            text = await resp.text()
        assert ("data: [DONE]" in text) is stream
    sent = await journal(session, prefill.url)
    assert len(sent) == 2
    first = orjson.loads(sent[0]["body"])
    assert first["kv_transfer_params"]["do_remote_decode"] is True
    assert first["kv_transfer_params"]["do_remote_prefill"] is False
    assert (first["max_tokens"], first["stream"]) == (1, False)
    assert PREFILL_HEADER not in sent[0]["headers"]
    decoded = [orjson.loads(e["body"]) for e in await journal(session, decode.url)]
    assert [d["stream"] for d in decoded] == [False, True]
    for d in decoded:
        params = d["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "prefill-0"
        assert params["remote_port"] == prefill.port
        assert params["remote_request_id"].startswith("chatcmpl-") and params["tp_size"] == 1
        assert params["remote_block_ids"], "one block id per block of the prompt"
        assert d["max_tokens"] == 4, "the decode request keeps the client's limit"
    assert sample(sidecar, "llm_d_disagg_sidecar_prefilled_requests_total", connector="nixlv2") == 2
    # the decode simulator counted the transferred prompt tokens and computed none of them
    counters = decode.engine.snapshot().counters
    assert counters.external_kv_tokens > 0
    assert counters.external_kv_tokens + counters.prefix_cache_hits == counters.prompt_tokens


async def test_no_header_is_decode_only_and_other_paths_pass_through(
    session: aiohttp.ClientSession, sims: tuple[SimServer, SimServer], sidecar_for: Stack
) -> None:
    prefill, decode = sims
    sidecar, url = await sidecar_for(decode.url)
    async with session.post(f"{url}/v1/completions", json={"prompt": "abc", "max_tokens": 2}) as resp:
        assert resp.status == 200
        assert "kv_transfer_params" not in await resp.json()
    async with session.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        assert "vllm:num_requests_running" in await resp.text(), "the engine's metrics, through the sidecar"
    async with session.get(f"{url}/v1/models") as resp:
        assert resp.status == 200
    assert await journal(session, prefill.url) == []
    assert sample(sidecar, "llm_d_disagg_sidecar_disagg_requests_total", connector="nixlv2") == 0


async def test_streaming_is_passed_through_as_it_comes(
    session: aiohttp.ClientSession, sidecar_for: Stack
) -> None:
    """The first chunk reaches the client while the engine still holds the rest back."""
    release = asyncio.Event()

    async def slow_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        await release.wait()
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", slow_stream)
    runner, address = await serve(app)
    try:
        _, url = await sidecar_for(f"http://{address}")
        async with session.post(f"{url}/v1/chat/completions", json=body(stream=True)) as resp:
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
            assert first == b"data: first\n\n"
            release.set()
            assert await resp.content.read() == b"data: [DONE]\n\n"
    finally:
        release.set()
        await runner.cleanup()


async def prefiller(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/{path:.*}", handler)
    return await serve(app)


async def _garbage(_: web.Request) -> web.Response:
    return web.Response(body=b"<html>not json", content_type="text/html")


async def _no_params(_: web.Request) -> web.Response:
    return web.json_response({"choices": []})


async def _error(_: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "boom"}}, status=500)


async def _hang(_: web.Request) -> web.Response:
    await asyncio.sleep(2)  # past the sidecar's 0.5 s prefill timeout
    return web.json_response({})


@pytest.mark.parametrize(
    ("handler", "reason"),
    [
        (_garbage, "invalid_response"),
        (_no_params, "invalid_response"),
        (_error, "status"),
        (_hang, "timeout"),
    ],
)
async def test_a_failed_prefill_is_served_decode_only(
    session: aiohttp.ClientSession,
    sims: tuple[SimServer, SimServer],
    sidecar_for: Stack,
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    reason: str,
) -> None:
    _, decode = sims
    runner, address = await prefiller(handler)
    try:
        sidecar, url = await sidecar_for(decode.url, prefill_timeout=0.5)
        async with session.post(
            f"{url}/v1/chat/completions", json=body(), headers={PREFILL_HEADER: address}
        ) as resp:
            assert resp.status == 200
            answer = await resp.json()
        assert answer["choices"][0]["message"]["content"]
        decoded = await journal(session, decode.url)
        assert len(decoded) == 1 and "kv_transfer_params" not in decoded[0]["body"]
        assert sample(sidecar, "llm_d_disagg_sidecar_decode_only_fallbacks_total", reason=reason) == 1
        assert sample(sidecar, "llm_d_disagg_sidecar_prefilled_requests_total", connector="nixlv2") == 0
    finally:
        await runner.cleanup()


async def test_an_unreachable_prefiller_is_served_decode_only(
    session: aiohttp.ClientSession, sims: tuple[SimServer, SimServer], sidecar_for: Stack
) -> None:
    _, decode = sims
    runner, address = await prefiller(_garbage)
    await runner.cleanup()  # nothing listens there any more
    sidecar, url = await sidecar_for(decode.url)
    async with session.post(
        f"{url}/v1/chat/completions", json=body(), headers={PREFILL_HEADER: address}
    ) as resp:
        assert resp.status == 200
    assert sample(sidecar, "llm_d_disagg_sidecar_decode_only_fallbacks_total", reason="unreachable") == 1


async def test_bad_input_gets_a_clear_400(
    session: aiohttp.ClientSession, sims: tuple[SimServer, SimServer], sidecar_for: Stack
) -> None:
    prefill, decode = sims
    sidecar, url = await sidecar_for(decode.url)
    async with session.post(
        f"{url}/v1/chat/completions", json=body(), headers={PREFILL_HEADER: "10.0.0.1"}
    ) as resp:
        assert resp.status == 400
        assert "malformed x-prefiller-host-port header" in (await resp.json())["error"]["message"]
    target = {PREFILL_HEADER: f"127.0.0.1:{prefill.port}"}
    async with session.post(f"{url}/v1/chat/completions", data=b"{not json", headers=target) as resp:
        assert resp.status == 400
        assert "Invalid JSON body" in (await resp.json())["error"]["message"]
    async with session.post(f"{url}/v1/chat/completions", json=[1, 2], headers=target) as resp:
        assert resp.status == 400
    assert await journal(session, prefill.url) == [] and await journal(session, decode.url) == []
    assert sample(sidecar, "llm_d_disagg_sidecar_bad_requests_total", reason="header") == 1
    assert sample(sidecar, "llm_d_disagg_sidecar_bad_requests_total", reason="body") == 2


async def test_ssrf_protection_refuses_endpoints_outside_the_pool(
    session: aiohttp.ClientSession, sims: tuple[SimServer, SimServer], sidecar_for: Stack
) -> None:
    prefill, decode = sims
    allow = AllowList()
    allow.upsert(meta("prefill-0", "127.0.0.1", prefill.port, "prefill"))
    allow.upsert(meta("decode-0", "127.0.0.1", decode.port, "decode"))
    sidecar, url = await sidecar_for(decode.url, allow=allow)
    # before the pool is known: no prefill endpoint is called, the request is served decode-only
    async with session.post(
        f"{url}/v1/chat/completions", json=body(), headers={PREFILL_HEADER: f"127.0.0.1:{prefill.port}"}
    ) as resp:
        assert resp.status == 200
    assert await journal(session, prefill.url) == []
    assert (
        sample(sidecar, "llm_d_disagg_sidecar_decode_only_fallbacks_total", reason="allowlist_not_ready") == 1
    )
    await session.delete(f"{decode.url}/debug/requests")
    allow.set_ready(True)
    for target in ("169.254.169.254:80", f"127.0.0.1:{decode.port}", "localhost:6379"):
        async with session.post(
            f"{url}/v1/chat/completions", json=body(), headers={PREFILL_HEADER: target}
        ) as resp:
            assert resp.status == 403, target
            assert "SSRF protection" in (await resp.json())["error"]["message"]
    assert sample(sidecar, "llm_d_disagg_sidecar_ssrf_denied_total") == 3
    assert await journal(session, decode.url) == [], "a refused request reaches no engine"
    async with session.post(
        f"{url}/v1/chat/completions", json=body(), headers={PREFILL_HEADER: f"127.0.0.1:{prefill.port}"}
    ) as resp:
        assert resp.status == 200
    assert len(await journal(session, prefill.url)) == 1


async def test_shared_storage_prefills_then_decodes_the_original(
    session: aiohttp.ClientSession, sims: tuple[SimServer, SimServer], sidecar_for: Stack
) -> None:
    prefill, decode = sims
    sidecar, url = await sidecar_for(decode.url, connector=connectors.SHARED_STORAGE)
    sent = body(stream=True, stream_options={"include_usage": True})
    async with session.post(
        f"{url}/v1/chat/completions", json=sent, headers={PREFILL_HEADER: f"127.0.0.1:{prefill.port}"}
    ) as resp:
        assert resp.status == 200
        assert "data: [DONE]" in await resp.text()
    (first,) = [orjson.loads(e["body"]) for e in await journal(session, prefill.url)]
    assert (first["max_tokens"], first["stream"]) == (1, False)
    assert "kv_transfer_params" not in first and "stream_options" not in first
    (decoded,) = [orjson.loads(e["body"]) for e in await journal(session, decode.url)]
    assert decoded == sent, "the decode engine gets the client's request as sent"
    assert sample(sidecar, "llm_d_disagg_sidecar_prefilled_requests_total", connector="shared-storage") == 1


async def test_sglang_sends_the_bootstrap_to_both_at_once(
    session: aiohttp.ClientSession, sidecar_for: Stack
) -> None:
    seen: dict[str, dict[str, Any]] = {}
    both_in = asyncio.Event()

    def recorder(role: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            seen[role] = await request.json()
            if len(seen) == 2:
                both_in.set()
            await asyncio.wait_for(both_in.wait(), 5)  # each waits for the other: they are concurrent
            return web.json_response({"choices": [{"message": {"content": role}}]})

        return handle

    prefill_runner, prefill_address = await prefiller(recorder("prefill"))
    decode_runner, decode_address = await prefiller(recorder("decode"))
    try:
        sidecar, url = await sidecar_for(
            f"http://{decode_address}", connector=connectors.SGLANG, sglang_bootstrap_port=8998
        )
        async with session.post(
            f"{url}/v1/chat/completions", json=body(), headers={PREFILL_HEADER: prefill_address}
        ) as resp:
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["message"]["content"] == "decode"
        assert seen["prefill"] == seen["decode"]
        assert seen["decode"]["bootstrap_host"] == "127.0.0.1"
        assert seen["decode"]["bootstrap_port"] == 8998
        assert isinstance(seen["decode"]["bootstrap_room"], int)
        assert seen["decode"]["max_tokens"] == 4
        for _ in range(50):
            if sample(sidecar, "llm_d_disagg_sidecar_prefilled_requests_total", connector="sglang") == 1:
                break
            await asyncio.sleep(0.05)
        assert sample(sidecar, "llm_d_disagg_sidecar_prefilled_requests_total", connector="sglang") == 1
    finally:
        await prefill_runner.cleanup()
        await decode_runner.cleanup()


async def test_an_unreachable_decoder_is_a_clear_502(
    session: aiohttp.ClientSession, sidecar_for: Stack
) -> None:
    runner, address = await prefiller(_garbage)
    await runner.cleanup()
    sidecar, url = await sidecar_for(f"http://{address}")
    async with session.post(f"{url}/v1/chat/completions", json=body()) as resp:
        assert resp.status == 502
        assert "decode engine is unreachable" in (await resp.json())["error"]["message"]
    assert b"llm_d_disagg_sidecar_request_errors_total" in generate_latest(sidecar.metrics.registry)
