"""The KV connector protocols: how the prefill request and the decode request are built.

``nixlv2`` (vLLM's NIXL connector): the prefill endpoint gets the request with
``kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false, remote_*: null}``, one output
token and no streaming; its answer's ``kv_transfer_params`` (where the KV blocks are) go into the
decode request. ``shared-storage`` (vLLM's example/shared-storage connectors, LMCache with a shared
backend): the same prefill without ``kv_transfer_params``, then the client's request unchanged (the
decode engine finds the prompt's KV in the storage both share). ``sglang``: both get
``bootstrap_host`` (the prefill host), ``bootstrap_port`` and a random ``bootstrap_room``, and are sent
at once (the decode engine pulls the KV from the room).
"""

from __future__ import annotations

import random
from typing import Any

NIXLV2 = "nixlv2"
SHARED_STORAGE = "shared-storage"
SGLANG = "sglang"
CONNECTORS = (NIXLV2, SHARED_STORAGE, SGLANG)
DEFAULT_SGLANG_BOOTSTRAP_PORT = 8998
KV_TRANSFER_PARAMS = "kv_transfer_params"


class PrefillResponseError(ValueError):
    """The prefill endpoint's answer has no usable ``kv_transfer_params``."""


def nixl_prefill_body(body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    """The prefill request: the client's, asking for one token, not streamed, KV kept for a decoder."""
    prefill = single_token_body(body, chat=chat)
    prefill[KV_TRANSFER_PARAMS] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return prefill


def single_token_body(body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    """The client's request asking for one output token, not streamed."""
    prefill = dict(body)
    prefill["max_tokens"] = 1
    if chat and "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    for name in ("stream_options", "min_tokens"):
        prefill.pop(name, None)
    return prefill


def nixl_transfer_params(response: object) -> dict[str, Any]:
    """The ``kv_transfer_params`` object of a prefill answer, or ``PrefillResponseError``."""
    if not isinstance(response, dict):
        raise PrefillResponseError("the prefill answer is not a JSON object")
    params = response.get(KV_TRANSFER_PARAMS)
    if not isinstance(params, dict):
        raise PrefillResponseError("the prefill answer has no kv_transfer_params object")
    return params


def nixl_decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    return {**body, KV_TRANSFER_PARAMS: params}


def sglang_body(body: dict[str, Any], host: str, bootstrap_port: int, rng: random.Random) -> dict[str, Any]:
    """The request both engines get: the client's with the bootstrap rendezvous."""
    return {
        **body,
        "bootstrap_host": host,
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": rng.getrandbits(63),
    }
