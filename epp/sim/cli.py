"""``epp sim``: command-line flags and the blocking entry point of the simulated vLLM server."""

from __future__ import annotations

import argparse
import asyncio
import signal
from dataclasses import fields

from epp.sim.engine import SimConfig
from epp.sim.server import SimServer

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
        help="prefill time in ms (default %(default)s)",
    )
    add(
        "--inter-token-latency",
        type=_non_negative_float,
        default=d.inter_token_latency,
        metavar="MS",
        help="time between output tokens in ms (default %(default)s)",
    )
    add(
        "--max-tokens",
        type=_positive_int,
        default=d.max_tokens,
        help="output length when the request sets no max_tokens (default %(default)s)",
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
        help="max_lora reported in vllm:lora_requests_info (default %(default)s)",
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
    values["served_model_names"] = tuple(values.get("served_model_names") or ())
    return SimConfig(**values)


def main(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM, then shut down cleanly; returns the exit status."""
    asyncio.run(serve(config_from_args(args)))
    return 0


async def serve(config: SimConfig, stop: asyncio.Event | None = None) -> None:
    """Run a simulator until ``stop`` is set or the process receives SIGINT/SIGTERM."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = _install_signal_handlers(loop, stop)
    try:
        async with SimServer(config):
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


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative number") from None
    if not value >= 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative number")
    return value
