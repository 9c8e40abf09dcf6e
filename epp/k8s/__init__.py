"""Kubernetes: the data layer's cluster side (list/watch with kubernetes-asyncio) and leader election.

* ``client`` — an API client from ``--kubeconfig``, the in-cluster service account or ``~/.kube/config``;
* ``resources`` — the kinds epp reads (Pod, InferencePool, InferenceObjective, InferenceModelRewrite);
* ``reflector`` — a resilient list-then-watch loop keeping a local copy of one kind;
* ``pods`` — Ready pods → rank endpoints (``<pod>-rank-<i>``) in the endpoint store;
* ``pool_discovery`` — the InferencePool (or ``--endpoint-selector``) drives the pods' selector and ports;
* ``alpha`` — InferenceObjective / InferenceModelRewrite reflectors feeding their stores;
* ``leader`` — leader election on a coordination.k8s.io Lease.

Nothing here is on the per-request path: the director reads the stores these modules fill.
"""
