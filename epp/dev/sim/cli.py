"""``epp sim``: command-line flags and the blocking entry point of the simulated vLLM server."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from dataclasses import fields

from epp.dev.sim.block_hash import HASH_ALGORITHMS
from epp.dev.sim.engine import FAILURE_TYPES, METRICS_FAULTS, ROLES, SimConfig
from epp.dev.sim.kv_events import ENCODINGS, LAYOUTS, REPLAY_FORMATS, KVEventsConfig
from epp.dev.sim.server import SimCluster
from epp.dev.sim.tokens import tokenizer_for
from epp.tokenization import DEFAULT_TOKENIZER_DIR, TokenizerError

_DEFAULTS = SimConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the simulator's flags (every one has a default) to ``parser``."""
    d = _DEFAULTS
    add = parser.add_argument
    add("--port", type=_port, default=d.port, help="listen port; 0 picks a free one (default %(default)s)")
    add("--host", default=d.host, help="listen address (default %(default)s)")
    add("--model", default=d.model, help="model name served (default %(default)s)")
    add(
        "--served-model-name",
        dest="served_model_names",
        nargs="+",
        default=list(d.served_model_names),
        metavar="NAME",
        help="extra model names served besides --model",
    )
    add("--name", default=d.name, help="pod name reported in x-inference-pod (default sim-<port>)")
    add(
        "--namespace",
        default=d.namespace,
        help="namespace reported in x-inference-namespace (default %(default)s)",
    )
    add(
        "--max-num-seqs",
        type=_positive_int,
        default=d.max_num_seqs,
        help="requests running at once (default %(default)s)",
    )
    add(
        "--max-waiting",
        type=_non_negative_int,
        default=d.max_waiting,
        help="waiting-queue cap; beyond it requests get 429 (default %(default)s)",
    )
    add(
        "--time-to-first-token",
        type=_non_negative_float,
        default=d.time_to_first_token,
        metavar="MS",
        help="prefill overhead in ms, paid by every request (default %(default)s)",
    )
    add(
        "--prefill-time-per-token",
        type=_non_negative_float,
        default=d.prefill_time_per_token,
        metavar="MS",
        help="prefill time per uncached prompt token in ms (default %(default)s)",
    )
    add(
        "--time-to-first-token-std-dev",
        type=_non_negative_float,
        default=d.time_to_first_token_std_dev,
        metavar="MS",
        help="standard deviation of the prefill overhead in ms (default %(default)s)",
    )
    add(
        "--inter-token-latency",
        type=_non_negative_float,
        default=d.inter_token_latency,
        metavar="MS",
        help="time between output tokens in ms (default %(default)s)",
    )
    add(
        "--inter-token-latency-std-dev",
        type=_non_negative_float,
        default=d.inter_token_latency_std_dev,
        metavar="MS",
        help="standard deviation of the inter-token latency in ms (default %(default)s)",
    )
    add(
        "--time-factor-under-load",
        type=_non_negative_float,
        default=d.time_factor_under_load,
        help="extra slowdown of TTFT and ITL with a full batch: latency x (1 + factor x (running - 1)"
        " / (max-num-seqs - 1)) (default %(default)s)",
    )
    add(
        "--max-tokens",
        type=_positive_int,
        default=d.max_tokens,
        help="output length when the request sets no max_tokens (default %(default)s)",
    )
    add(
        "--max-model-len",
        type=_positive_int,
        default=d.max_model_len,
        metavar="TOKENS",
        help="context length: a longer prompt, or prompt + max_tokens beyond it, gets 400"
        " (default %(default)s)",
    )
    add(
        "--tokenizer",
        type=_tokenizer,
        default=d.tokenizer,
        metavar="PATH",
        help="HF tokenizer directory (tokenizer.json, tokenizer_config.json with the chat template) for"
        f" prompts, usage and the KV cache (default: the shipped {DEFAULT_TOKENIZER_DIR.name})",
    )
    add(
        "--kv-cache-size",
        type=_positive_int,
        default=d.kv_cache_size,
        metavar="BLOCKS",
        help="KV-cache capacity in blocks (default %(default)s)",
    )
    add(
        "--block-size",
        type=_positive_int,
        default=d.block_size,
        metavar="TOKENS",
        help="tokens per KV-cache block (default %(default)s)",
    )
    add(
        "--max-loras",
        type=_non_negative_int,
        default=d.max_loras,
        help="LoRA adapters loaded at once (default %(default)s)",
    )
    add(
        "--lora-modules",
        nargs="+",
        default=list(d.lora_modules),
        metavar="NAME",
        help="LoRA adapters served on top of --model (requests name them as their model)",
    )
    add(
        "--lora-load-time",
        type=_non_negative_float,
        default=d.lora_load_time,
        metavar="MS",
        help="time to load an adapter into a slot in ms (default %(default)s)",
    )
    add(
        "--max-cpu-loras",
        type=_non_negative_int,
        default=d.max_cpu_loras,
        help="LoRA adapters kept in the host cache, GPU-resident ones included (default: --max-loras)",
    )
    add(
        "--lora-host-load-time",
        type=_non_negative_float,
        default=d.lora_host_load_time,
        metavar="MS",
        help="time to load an adapter from the host cache into a slot in ms (default %(default)s)",
    )
    add(
        "--failure-injection-rate",
        type=_probability,
        default=d.failure_injection_rate,
        help="fraction of inference requests answered with an injected error (default %(default)s)",
    )
    add(
        "--failure-types",
        nargs="+",
        choices=FAILURE_TYPES,
        default=list(d.failure_types),
        metavar="TYPE",
        help=f"errors injected, drawn uniformly: {', '.join(FAILURE_TYPES)} (default all)",
    )
    add(
        "--metrics-fault",
        choices=METRICS_FAULTS,
        default=d.metrics_fault,
        help="break GET /metrics while inference keeps working: error answers 500, hang never answers,"
        " garbage answers 200 with text that is no Prometheus exposition (default %(default)s)",
    )
    add(
        "--metrics-port",
        type=_port,
        default=d.metrics_port,
        help="serve /metrics on this port instead of --port, as engines with a separate metrics server"
        " do (rank i: port + i; default 0: on --port)",
    )
    add(
        "--dcgm-port",
        type=_port,
        default=d.dcgm_port,
        help="serve a DCGM-exporter-like /metrics (DCGM_FI_DEV_GPU_UTIL = 100 x running / max-num-seqs,"
        " labelled with the pod name) on this port (rank i: port + i; default 0: off)",
    )
    add(
        "--role",
        choices=ROLES,
        default=d.role,
        help="disaggregation role: prefill answers kv_transfer_params, decode skips remotely"
        " prefilled prompts, prefill-decode (or its old name both) does both (default %(default)s)",
    )
    add(
        "--data-parallel-size",
        type=_positive_int,
        default=d.data_parallel_size,
        metavar="N",
        help="independent engines (ranks) on consecutive ports from --port (default %(default)s)",
    )
    add(
        "--kv-events-config",
        type=_kv_events_config,
        default=d.kv_events_config,
        metavar="JSON",
        help='vLLM\'s KV events config, e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557",'
        ' "replay_endpoint": "tcp://*:5558"}\' (fields: enable_kv_cache_events, publisher, endpoint,'
        ' replay_endpoint, buffer_steps, hwm, max_queue_size, topic; topic default "" as vLLM\'s;'
        " rank i: ports + i; default off)",
    )
    add(
        "--kv-events-encoding",
        choices=ENCODINGS,
        default=d.kv_events_encoding,
        help="KV events as positional arrays (older vLLM) or field-name maps (newer vLLM)"
        " (default %(default)s)",
    )
    add(
        "--kv-events-layout",
        choices=list(LAYOUTS),
        default=d.kv_events_layout,
        metavar="LAYOUT",
        help="publish KV events as this engine version does (overrides --kv-events-encoding; its block"
        f" hashing too): {', '.join(LAYOUTS)} (default: the encoding's, vllm-0.34 for map)",
    )
    add(
        "--kv-events-replay-format",
        choices=REPLAY_FORMATS,
        default=d.kv_events_replay_format,
        help="replay replies with the topic frame (newer vLLM) or without it (older vLLM)"
        " (default %(default)s)",
    )
    add(
        "--load-publish-port",
        type=int,
        default=d.load_publish_port,
        metavar="PORT",
        help="publish SGLang's LoadStat (running, waiting, KV tokens) over ZMQ PUB on this port"
        " (rank i: port + i; default off)",
    )
    add(
        "--load-publish-interval-ms",
        type=_non_negative_float,
        default=d.load_publish_interval_ms,
        metavar="MS",
        help="LoadStat period (default %(default)s)",
    )
    add(
        "--prefix-caching-hash-algo",
        choices=HASH_ALGORITHMS,
        default=d.prefix_caching_hash_algo,
        help="vLLM's block hash; seeded from PYTHONHASHSEED (unset: vLLM's fixed default seed for sha256"
        " and sha256_cbor since 0.29, else random) (default %(default)s)",
    )
    add("--seed", type=int, default=d.seed, help="random seed for jitter and failure injection")
    add(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details (cached prompt tokens), as vLLM's flag; without it they are"
        " null, as in vLLM",
    )
    add(
        "--enable-scale-out",
        action="store_true",
        help="serve the render (/v1/completions/render, /v1/chat/completions/render) and token-in"
        " (/inference/v1/generate) endpoints, as vLLM 0.32's flag; without it they answer 403, as in vLLM",
    )
    add(
        "--keep-alive",
        type=_non_negative_float,
        default=d.keep_alive,
        metavar="SECONDS",
        help="an idle keep-alive connection is closed after this long, as vLLM's server does after 5 s"
        " (default %(default)s)",
    )
    add(
        "--time-scale",
        type=_non_negative_float,
        default=d.time_scale,
        help="factor applied to every simulated delay (default %(default)s)",
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The :class:`SimConfig` described by parsed flags (missing attributes keep their defaults)."""
    values = {f.name: getattr(args, f.name) for f in fields(SimConfig) if hasattr(args, f.name)}
    for name in ("served_model_names", "lora_modules"):
        values[name] = tuple(values.get(name) or ())
    if "failure_types" in values:
        values["failure_types"] = tuple(values["failure_types"])
    return SimConfig(**values)


def main(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM, then shut down cleanly; returns the exit status (1: a port
    could not be bound)."""
    try:
        asyncio.run(serve(config_from_args(args)))
    except OSError as exc:
        print(f"epp sim: error: {exc}", file=sys.stderr)
        return 1
    return 0


async def serve(config: SimConfig, stop: asyncio.Event | None = None) -> None:
    """Run a simulator until ``stop`` is set or the process receives SIGINT/SIGTERM."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = _install_signal_handlers(loop, stop)
    try:
        async with SimCluster(config):
            await stop.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def _install_signal_handlers(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> list[signal.Signals]:
    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signal support
            continue
        installed.append(sig)
    return installed


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tokenizer(text: str) -> str:
    try:
        tokenizer_for(text)
    except TokenizerError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _positive_int(text: str) -> int:
    return _checked_int(text, 1, "a positive integer")


def _non_negative_int(text: str) -> int:
    return _checked_int(text, 0, "a non-negative integer")


def _port(text: str) -> int:
    value = _checked_int(text, 0, "a port in 0..65535")
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port in 0..65535")
    return value


def _checked_int(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def _probability(text: str) -> float:
    value = _non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in 0..1")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative number") from None
    if not value >= 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative number")
    return value
