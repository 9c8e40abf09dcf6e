"""A small, strict stand-in for ``kustomize build`` (kustomize has no Python package).

It renders the subset of the Kustomization format that ``deploy/kubernetes/`` uses and **refuses
everything else** (``UnsupportedKustomization``), so a kustomization can never silently mean
something else to ``kubectl apply -k`` than to the tests:

* ``resources``: YAML files inside the kustomization's directory (kustomize's default load
  restrictor) and other kustomization directories (rendered recursively); no URLs;
* ``configMapGenerator``: ``name`` plus ``files`` (``path`` or ``key=path``) and/or ``literals``,
  with ``options.disableNameSuffixHash: true`` (the hash suffix and the rewriting of references to it
  are not emulated) and no ``behavior`` other than ``create``;
* ``patches``: RFC 6902 JSON patches only (inline ``patch`` or ``path``), each with a ``target`` of
  ``group``/``version``/``kind``/``name``. A strategic-merge patch is refused, and a target that
  matches no object is an error (kustomize would ignore it silently);
* ``images``: ``name`` with ``newName``/``newTag``/``digest``, applied to the containers and init
  containers of pod templates and pods.

Output objects come in kustomize's input order (resources, then generated ConfigMaps); kustomize
itself sorts them by kind, which matters to nobody here. Duplicate objects are an error, as in kustomize.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

API_VERSION = "kustomize.config.k8s.io/v1beta1"
KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")

SUPPORTED_FIELDS = frozenset({"apiVersion", "kind", "resources", "configMapGenerator", "patches", "images"})
SUPPORTED_GENERATOR_FIELDS = frozenset({"name", "files", "literals", "options", "behavior"})
SUPPORTED_PATCH_FIELDS = frozenset({"patch", "path", "target"})
SUPPORTED_TARGET_FIELDS = frozenset({"group", "version", "kind", "name"})
SUPPORTED_IMAGE_FIELDS = frozenset({"name", "newName", "newTag", "digest"})
SUPPORTED_OPS = frozenset({"add", "remove", "replace", "test"})


class UnsupportedKustomization(Exception):
    """The kustomization uses a field or form this helper does not emulate (extend it, with a test)."""


class KustomizeError(Exception):
    """The kustomization is invalid (kustomize itself would fail too)."""


Object = dict[str, Any]


def kustomization_file(directory: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        path = directory / name
        if path.is_file():
            return path
    raise KustomizeError(f"{directory}: no kustomization file")


def build(directory: Path | str) -> list[Object]:
    """Render the kustomization in ``directory`` like ``kustomize build`` (see the module docstring)."""
    directory = Path(directory).resolve()
    path = kustomization_file(directory)
    doc = yaml.safe_load(path.read_text()) or {}
    _only(doc, SUPPORTED_FIELDS, str(path))
    if (
        doc.get("apiVersion", API_VERSION) != API_VERSION
        or doc.get("kind", "Kustomization") != "Kustomization"
    ):
        raise UnsupportedKustomization(f"{path}: only apiVersion {API_VERSION}, kind Kustomization")

    objects: list[Object] = []
    for entry in doc.get("resources") or []:
        objects.extend(_resource(directory, entry, path))
    for gen in doc.get("configMapGenerator") or []:
        objects.append(_config_map(directory, gen, path))
    _check_unique(objects, path)
    for i, patch in enumerate(doc.get("patches") or []):
        _apply_patch(directory, patch, objects, f"{path}: patches[{i}]")
    for image in doc.get("images") or []:
        _only(image, SUPPORTED_IMAGE_FIELDS, f"{path}: images")
        _set_image(objects, image)
    return objects


def _only(mapping: Any, allowed: frozenset[str], where: str) -> None:
    if not isinstance(mapping, dict):
        raise KustomizeError(f"{where}: expected a mapping, got {type(mapping).__name__}")
    extra = sorted(set(mapping) - allowed)
    if extra:
        raise UnsupportedKustomization(
            f"{where}: unsupported field(s) {extra} (supported: {sorted(allowed)})"
        )


def _inside(directory: Path, relative: str, where: str) -> Path:
    target = (directory / relative).resolve()
    if not target.is_relative_to(directory):
        raise KustomizeError(f"{where}: {relative!r} is outside {directory} (kustomize's load restrictor)")
    return target


def _resource(directory: Path, entry: Any, where: Path) -> list[Object]:
    if not isinstance(entry, str) or "://" in entry or entry.startswith(("github.com/", "git@")):
        raise UnsupportedKustomization(f"{where}: resource {entry!r}: only local files and directories")
    target = (directory / entry).resolve()
    if target.is_dir():
        return build(target)
    target = _inside(directory, entry, str(where))
    if not target.is_file():
        raise KustomizeError(f"{where}: resource {entry!r} not found")
    docs = [d for d in yaml.safe_load_all(target.read_text()) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or "kind" not in d or "apiVersion" not in d:
            raise KustomizeError(f"{target}: every document must be a Kubernetes object")
        if d["kind"].endswith("List"):
            raise UnsupportedKustomization(f"{target}: List kinds are not supported")
    return docs


def _config_map(directory: Path, gen: Any, where: Path) -> Object:
    _only(gen, SUPPORTED_GENERATOR_FIELDS, f"{where}: configMapGenerator")
    if gen.get("behavior", "create") != "create":
        raise UnsupportedKustomization(f"{where}: configMapGenerator behavior {gen['behavior']!r}")
    options = gen.get("options") or {}
    _only(options, frozenset({"disableNameSuffixHash"}), f"{where}: configMapGenerator options")
    if options.get("disableNameSuffixHash") is not True:
        raise UnsupportedKustomization(
            f"{where}: configMapGenerator {gen.get('name')!r} needs options.disableNameSuffixHash: true "
            "(name hashing is not emulated)"
        )
    data: dict[str, str] = {}
    for spec in gen.get("files") or []:
        key, sep, rel = str(spec).partition("=")
        if not sep:
            key, rel = Path(spec).name, spec
        data[key] = _inside(directory, rel, str(where)).read_text()
    for literal in gen.get("literals") or []:
        key, sep, value = str(literal).partition("=")
        if not sep:
            raise KustomizeError(f"{where}: literal {literal!r} is not key=value")
        data[key] = value
    if not gen.get("name") or not data:
        raise KustomizeError(f"{where}: configMapGenerator needs a name and at least one file or literal")
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data}


def object_id(obj: Object) -> tuple[str, str, str, str]:
    group, _, _version = obj["apiVersion"].rpartition("/")
    meta = obj.get("metadata") or {}
    return (group, obj["kind"], meta.get("namespace", ""), meta.get("name", ""))


def _check_unique(objects: list[Object], where: Path) -> None:
    seen: set[tuple[str, str, str, str]] = set()
    for obj in objects:
        oid = object_id(obj)
        if oid in seen:
            raise KustomizeError(f"{where}: duplicate object {oid}")
        seen.add(oid)


# ------------------------------------------------------------------------------------ patches


def _matches(obj: Object, target: dict[str, str]) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    return (
        target.get("kind", obj["kind"]) == obj["kind"]
        and target.get("name", obj["metadata"].get("name")) == obj["metadata"].get("name")
        and target.get("group", group) == group
        and target.get("version", version) == version
    )


def _apply_patch(directory: Path, patch: Any, objects: list[Object], where: str) -> None:
    _only(patch, SUPPORTED_PATCH_FIELDS, where)
    if ("patch" in patch) == ("path" in patch):
        raise KustomizeError(f"{where}: exactly one of patch and path")
    text = patch["patch"] if "patch" in patch else _inside(directory, patch["path"], where).read_text()
    ops = yaml.safe_load(text)
    if not isinstance(ops, list):
        raise UnsupportedKustomization(f"{where}: only JSON 6902 patches (a list of operations)")
    target = patch.get("target")
    if not target:
        raise UnsupportedKustomization(f"{where}: a JSON 6902 patch needs a target")
    _only(target, SUPPORTED_TARGET_FIELDS, f"{where}: target")
    hits = [i for i, obj in enumerate(objects) if _matches(obj, target)]
    if not hits:
        raise KustomizeError(f"{where}: target {target} matches no object")
    for i in hits:
        objects[i] = json_patch(objects[i], ops, where)


def _pointer(path: str, where: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise KustomizeError(f"{where}: JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(container: list[Any], token: str, where: str, *, append: bool = False) -> int:
    if append and token == "-":
        return len(container)
    if not token.isdigit() or (token != "0" and token.startswith("0")):
        raise KustomizeError(f"{where}: bad array index {token!r}")
    i = int(token)
    if i > len(container) or (i == len(container) and not append):
        raise KustomizeError(f"{where}: array index {i} out of range")
    return i


def _walk(doc: Any, tokens: list[str], where: str) -> Any:
    for token in tokens:
        if isinstance(doc, dict):
            if token not in doc:
                raise KustomizeError(f"{where}: path element {token!r} not found")
            doc = doc[token]
        elif isinstance(doc, list):
            doc = doc[_index(doc, token, where)]
        else:
            raise KustomizeError(f"{where}: cannot descend into {type(doc).__name__} at {token!r}")
    return doc


def json_patch(doc: Object, ops: list[Any], where: str = "patch") -> Object:
    """Apply RFC 6902 ``add``/``remove``/``replace``/``test`` operations to a copy of ``doc``."""
    doc = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or op.get("op") not in SUPPORTED_OPS:
            raise UnsupportedKustomization(f"{where}: operation {op!r} (supported: {sorted(SUPPORTED_OPS)})")
        tokens = _pointer(op.get("path", ""), where)
        if not tokens:
            raise UnsupportedKustomization(f"{where}: operations on the whole document")
        parent = _walk(doc, tokens[:-1], where)
        last = tokens[-1]
        kind = op["op"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise KustomizeError(f"{where}: {kind} needs a value")
        if isinstance(parent, dict):
            if kind in ("remove", "replace", "test") and last not in parent:
                raise KustomizeError(f"{where}: {op['path']} not found")
            if kind == "remove":
                del parent[last]
            elif kind == "test":
                if parent[last] != op["value"]:
                    raise KustomizeError(f"{where}: test failed at {op['path']}")
            else:
                parent[last] = copy.deepcopy(op["value"])
        elif isinstance(parent, list):
            i = _index(parent, last, where, append=kind == "add")
            if kind == "add":
                parent.insert(i, copy.deepcopy(op["value"]))
            elif kind == "remove":
                del parent[i]
            elif kind == "replace":
                parent[i] = copy.deepcopy(op["value"])
            elif parent[i] != op["value"]:
                raise KustomizeError(f"{where}: test failed at {op['path']}")
        else:
            raise KustomizeError(f"{where}: {op['path']}: parent is not a container")
    return doc


# ------------------------------------------------------------------------------------- images


def pod_spec(obj: Object) -> dict[str, Any] | None:
    """The pod spec of a Pod or of a workload's pod template (None for other kinds)."""
    if obj["kind"] == "Pod":
        return obj.get("spec")
    spec = obj.get("spec") or {}
    if obj["kind"] == "CronJob":
        spec = (spec.get("jobTemplate") or {}).get("spec") or {}
    template = spec.get("template")
    return template.get("spec") if isinstance(template, dict) else None


def _split_image(image: str) -> tuple[str, str]:
    """``repo[:tag][@digest]`` → (repo, the rest including its separator)."""
    at = image.find("@")
    base, digest = (image[:at], image[at:]) if at >= 0 else (image, "")
    colon = base.rfind(":")
    if colon > base.rfind("/"):
        return base[:colon], base[colon:] + digest
    return base, digest


def _set_image(objects: list[Object], image: dict[str, str]) -> None:
    for obj in objects:
        spec = pod_spec(obj)
        if not spec:
            continue
        for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
            repo, suffix = _split_image(container.get("image", ""))
            if repo != image["name"]:
                continue
            repo = image.get("newName", repo)
            if "digest" in image:
                suffix = "@" + image["digest"]
            elif "newTag" in image:
                suffix = ":" + image["newTag"]
            container["image"] = repo + suffix
