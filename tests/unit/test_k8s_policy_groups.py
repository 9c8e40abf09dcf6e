"""InferenceObjective / InferenceModelRewrite in the ``llm-d.ai`` group and the deprecated
``inference.networking.x-k8s.io`` one, against the fake API server with either, both or neither CRD
group installed: ``llm-d.ai`` wins whenever it is installed (the deprecated group's objects are then
ignored, also those of the same name), the deprecated group is read when it is the only one, and a
group installed after start-up is picked up without a restart.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
import structlog
from kubernetes_asyncio import client

from epp.datalayer.objectives import ObjectiveStore
from epp.datalayer.rewrites import RewriteStore
from epp.k8s import policy_watchers
from epp.k8s.policy_watchers import PolicyWatchers
from tests.fakekube import FakeKube, objects
from tests.unit.polling import until

NS = "ns"
LLMD = "llm-d.ai"
LEGACY = "inference.networking.x-k8s.io"
POOL_GROUP = "inference.networking.k8s.io"


@pytest.fixture
async def stores(api: client.ApiClient) -> AsyncIterator[tuple[ObjectiveStore, RewriteStore, PolicyWatchers]]:
    objectives = ObjectiveStore(pool_name="pool", pool_group=POOL_GROUP)
    rewrites = RewriteStore(pool_name="pool", pool_group=POOL_GROUP)
    watchers = PolicyWatchers(api, NS, objectives=objectives, rewrites=rewrites)
    yield objectives, rewrites, watchers
    await watchers.stop()


def _both(kube: FakeKube, name: str, priority: int, target: str, api_version: str) -> None:
    kube.create(objects.objective(NS, name, priority, api_version=api_version))
    kube.create(objects.model_rewrite(NS, name, "alias", {target: 1}, api_version=api_version))


def _rewrite_of(rewrites: RewriteStore, model: str) -> tuple[str, str] | None:
    return rewrites.choose(model, random.Random(0))


async def test_only_llm_d_ai_installed_is_read(
    kube: FakeKube, stores: tuple[ObjectiveStore, RewriteStore, PolicyWatchers]
) -> None:
    objectives, rewrites, watchers = stores
    _both(kube, "critical", 7, "served-model", objects.POLICY_API)
    kube.set_group_installed(LEGACY, False)
    watchers.start()
    await until(lambda: objectives.priority("critical") == 7 and _rewrite_of(rewrites, "alias") is not None)
    assert _rewrite_of(rewrites, "alias") == ("served-model", "critical")
    assert [w.kind.api_version if w.kind else None for w in watchers.watches] == [f"{LLMD}/v1alpha2"] * 2
    # watch events flow on the chosen group
    kube.delete(objects.POLICY_API, "InferenceObjective", NS, "critical")
    await until(lambda: objectives.priority("critical") == 0)


async def test_only_the_deprecated_group_installed_is_read_with_a_deprecation_warning(
    kube: FakeKube, stores: tuple[ObjectiveStore, RewriteStore, PolicyWatchers]
) -> None:
    objectives, rewrites, watchers = stores
    _both(kube, "critical", 5, "legacy-model", objects.ALPHA_API)
    kube.set_group_installed(LLMD, False)
    with structlog.testing.capture_logs() as logs:
        watchers.start()
        await until(
            lambda: objectives.priority("critical") == 5 and _rewrite_of(rewrites, "alias") is not None
        )
    assert _rewrite_of(rewrites, "alias") == ("legacy-model", "critical")
    assert [w.kind.group if w.kind else None for w in watchers.watches] == [LEGACY, LEGACY]
    deprecations = [e for e in logs if e["event"].startswith("DEPRECATION")]
    assert {e["kind"] for e in deprecations} == {"InferenceObjective", "InferenceModelRewrite"}


async def test_both_installed_llm_d_ai_wins_and_the_deprecated_objects_are_ignored(
    kube: FakeKube, stores: tuple[ObjectiveStore, RewriteStore, PolicyWatchers]
) -> None:
    objectives, rewrites, watchers = stores
    # the same names in both groups, with different contents; plus one object only in the old group
    _both(kube, "critical", 9, "new-model", objects.POLICY_API)
    _both(kube, "critical", 1, "old-model", objects.ALPHA_API)
    kube.create(objects.objective(NS, "legacy-only", 3, api_version=objects.ALPHA_API))
    with structlog.testing.capture_logs() as logs:
        watchers.start()
        await until(
            lambda: objectives.priority("critical") == 9 and _rewrite_of(rewrites, "alias") is not None
        )
    assert _rewrite_of(rewrites, "alias") == ("new-model", "critical")
    assert objectives.priority("legacy-only") == 0  # not read: the reference ignores that group
    assert [w.kind.group if w.kind else None for w in watchers.watches] == [LLMD, LLMD]
    assert sum("both the" in e["event"] for e in logs) == 2
    # a change in the ignored group changes nothing; one in llm-d.ai does
    kube.patch(objects.ALPHA_API, "InferenceObjective", NS, "critical", {"spec": {"priority": 2}})
    kube.patch(objects.POLICY_API, "InferenceObjective", NS, "critical", {"spec": {"priority": 4}})
    await until(lambda: objectives.priority("critical") == 4)
    assert not any(LEGACY in path for _, path, _ in kube.requests if "inferenceobjectives" in path)


async def test_neither_installed_then_a_crd_group_is_installed_later(
    kube: FakeKube,
    stores: tuple[ObjectiveStore, RewriteStore, PolicyWatchers],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(policy_watchers, "MISSING_RETRY", 0.2)
    objectives, rewrites, watchers = stores
    _both(kube, "critical", 6, "late-model", objects.POLICY_API)
    kube.set_group_installed(LLMD, False)
    kube.set_group_installed(LEGACY, False)
    watchers.start()
    await until(lambda: all("CRD not installed" in w.last_error for w in watchers.watches))
    assert objectives.priority("critical") == 0 and _rewrite_of(rewrites, "alias") is None
    kube.set_group_installed(LLMD, True)
    await until(lambda: objectives.priority("critical") == 6 and _rewrite_of(rewrites, "alias") is not None)
    assert [w.kind.group if w.kind else None for w in watchers.watches] == [LLMD, LLMD]
    assert all(w.last_error == "" for w in watchers.watches)
