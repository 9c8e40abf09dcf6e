"""Parameter names of the llm-d-inference-scheduler era: migrated with one warning, or refused
naming the replacement (always when the meaning changed, and for ``--compat-version v0.11``)."""

from __future__ import annotations

import pytest

from epp.config import ConfigError, load_config

HEAD = "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\nplugins:\n"
TOKEN = HEAD + "- type: token-producer\n  parameters: {modelName: m, vllm: {http: 'http://127.0.0.1:8000'}}\n"


def test_vllm_http_loads_as_vllm_url_with_one_warning() -> None:
    cfg = load_config(TOKEN)
    assert cfg.plugins["token-producer"].params.vllm.url == "http://127.0.0.1:8000"
    warned = [w for w in cfg.warnings if "vllm.http" in w]
    assert len(warned) == 1 and "replaced by `vllm.url`" in warned[0]


def test_v011_refuses_vllm_http_naming_vllm_url() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TOKEN, compat_version="v0.11")
    assert info.value.field == "plugins[0].parameters.vllm.http"
    assert "replaced by `vllm.url`" in info.value.reason


def test_both_names_set_is_an_error() -> None:
    text = (
        HEAD
        + "- type: token-producer\n  parameters: {modelName: m, vllm: {http: 'http://a:1', url: 'http://b:1'}}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(text)
    assert "keep `vllm.url` only" in info.value.reason


def test_nested_token_processor_config_moves_to_the_top() -> None:
    text = HEAD + (
        "- type: precise-prefix-cache-producer\n"
        "  parameters: {indexerConfig: {tokenProcessorConfig: {blockSizeTokens: 5}}}\n"
    )
    cfg = load_config(text)
    assert cfg.plugins["precise-prefix-cache-producer"].params.token_processor_config.block_size_tokens == 5
    assert any("indexerConfig.tokenProcessorConfig" in w for w in cfg.warnings)


def test_hash_block_size_is_refused_naming_block_size_tokens() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(HEAD + "- type: prefix-cache-scorer\n  parameters: {hashBlockSize: 10}\n")
    assert info.value.field == "plugins[0].parameters.hashBlockSize"
    assert "`blockSizeTokens`" in info.value.reason


def test_old_saturation_detector_threshold_names_the_detector_plugin() -> None:
    text = (
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
        "saturationDetector:\n  queueDepthThreshold: 5\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(text)
    assert info.value.field == "saturationDetector.queueDepthThreshold"
    assert "utilization-detector" in info.value.reason
