"""An API client for the EPP: ``--kubeconfig``, else the pod's service account, else ``~/.kube/config``."""

from __future__ import annotations

import os

from kubernetes_asyncio import client, config

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class KubeConfigError(Exception):
    """No usable cluster configuration was found; the message says which sources were tried."""


async def api_client(
    kubeconfig: str | None = None,
    *,
    environ: dict[str, str] | None = None,
    service_account_dir: str = SERVICE_ACCOUNT_DIR,
) -> client.ApiClient:
    """A fresh ``ApiClient`` with its own ``Configuration`` (the library's global default is untouched).

    A kubeconfig (``kubeconfig`` or ``KUBECONFIG``) serves runs outside the cluster and the tests; in
    a pod the service account's token (re-read as it rotates) and CA are used.
    """
    env = dict(os.environ) if environ is None else environ
    cfg = client.Configuration()
    try:
        if kubeconfig:
            await config.load_kube_config(
                config_file=kubeconfig, client_configuration=cfg, persist_config=False
            )
        elif env.get("KUBERNETES_SERVICE_HOST"):
            config.incluster_config.InClusterConfigLoader(
                token_filename=os.path.join(service_account_dir, "token"),
                cert_filename=os.path.join(service_account_dir, "ca.crt"),
                environ=env,
            ).load_and_set(cfg)
        else:
            path = env.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
            if not os.path.exists(path.split(os.pathsep)[0]):
                raise KubeConfigError(
                    "no Kubernetes configuration: not in a cluster (KUBERNETES_SERVICE_HOST unset) "
                    f"and no kubeconfig at {path}; pass --kubeconfig"
                )
            await config.load_kube_config(config_file=path, client_configuration=cfg, persist_config=False)
    except config.ConfigException as e:
        raise KubeConfigError(f"Kubernetes configuration: {e}") from e
    return client.ApiClient(cfg)
