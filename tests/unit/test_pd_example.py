"""deploy/kubernetes/pd: the P/D example's pieces fit: the EPP runs the config ``epp run --pd`` runs,
the decode pods' sidecar flags parse with ``epp pd-sidecar``'s parser and name the pool's port, the
engine behind it and SSRF protection from the InferencePool; the roles are labelled for the filters."""

from __future__ import annotations

import argparse

import yaml

from epp.dev.stack.pd import PD_CONFIG_YAML, pd_config
from epp.sidecar.cli import add_arguments, pool_of
from tests.unit.test_deploy_manifests import one


def test_the_epp_runs_the_shipped_pd_config() -> None:
    cm = one("pd", "ConfigMap", "epp-config")
    assert cm["data"]["config.yaml"].strip() == PD_CONFIG_YAML.strip()
    assert yaml.safe_load(PD_CONFIG_YAML) == pd_config()
    decider = next(p for p in pd_config(99)["plugins"] if p["type"] == "prefix-based-pd-decider")
    assert decider["parameters"]["nonCachedTokens"] == 99


def test_decode_pods_run_the_sidecar_before_vllm() -> None:
    pool = one("pd", "InferencePool", "vllm-qwen")
    (port,) = (p["number"] for p in pool["spec"]["targetPorts"])
    decode = one("pd", "Deployment", "vllm-qwen-decode")
    pod = decode["spec"]["template"]
    assert pod["metadata"]["labels"]["llm-d.ai/role"] == "decode"
    assert (
        one("pd", "Deployment", "vllm-qwen-prefill")["spec"]["template"]["metadata"]["labels"][
            "llm-d.ai/role"
        ]
        == "prefill"
    )
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    sidecar, vllm = containers["pd-sidecar"], containers["vllm"]
    assert sidecar["command"] == ["epp", "pd-sidecar"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(sidecar["args"])
    assert args.port == port, "the pool's target port is the sidecar"
    assert f"--port={args.vllm_port}" in vllm["args"], "the sidecar forwards to its vLLM"
    assert args.connector == "nixlv2" and args.enable_ssrf_protection is True
    env = {e["name"]: e.get("value", "<from the pod>") for e in sidecar["env"]}
    assert pool_of(args.inference_pool, env) == ("<from the pod>", pool["metadata"]["name"])
    assert pod["spec"]["serviceAccountName"] == "pd-sidecar"
    role = one("pd", "Role", "pd-sidecar")
    assert {r["resources"][0] for r in role["rules"]} == {"pods", "inferencepools"}
