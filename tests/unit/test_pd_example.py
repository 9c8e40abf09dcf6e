"""deploy/kubernetes/pd: the P/D example's pieces fit: the EPP runs the config ``epp run --pd`` runs,
the decode pods' sidecar flags parse with ``epp pd-sidecar``'s parser and name the pool's port, the
engine behind it and SSRF protection from the InferencePool; the roles are labelled for the filters."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
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


def test_epp_run_pd_refuses_what_cannot_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from epp.cli import main
    from epp.dev.stack import StackOptions
    from epp.dev.stack.pd import PDStack

    with pytest.raises(ValueError, match="at least one prefill and one decode simulator are needed"):
        PDStack(StackOptions(sims=3), tmp_path, prefill_sims=3)
    with pytest.raises(ValueError, match="one EPP"):
        PDStack(StackOptions(sims=3, replicas=2), tmp_path)
    stack = PDStack(StackOptions(sims=4, sim_base_port=8000), tmp_path, prefill_sims=2)
    assert stack.prefill_ports == [8000, 8001]
    assert [(d.sidecar_port, d.engine_port) for d in stack.decoders] == [(8004, 8002), (8005, 8003)]
    assert stack.opts.config == pd_config(), "the example's config when none is given"
    assert main(["run", "--pd", "3", "--sims", "3"]) == 2
    assert (
        "error: --pd: at least one prefill and one decode simulator are needed (3 prefill of 3"
        in capsys.readouterr().err
    )
