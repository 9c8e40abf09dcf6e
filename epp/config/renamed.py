"""Plugin parameters that llm-d releases renamed or moved after the llm-d-inference-scheduler era
(v0.8): migrated to the current name with one warning per occurrence, before plugins are created,
or refused naming the current name when the load asks for ``--compat-version v0.11``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epp.config.context import LoadContext
from epp.config.schema import PluginSpec
from epp.framework.errors import ConfigError


@dataclass(slots=True, frozen=True)
class _Rename:
    types: frozenset[str]
    old: tuple[str, ...]  # path inside parameters
    new: tuple[str, ...]
    since: str  # where the rename happened
    refuse: str = ""  # not migrated (the meaning changed): why, and what to set instead


_PRECISE = frozenset({"precise-prefix-cache-scorer", "precise-prefix-cache-producer"})
_APPROX = frozenset({"prefix-cache-scorer", "approx-prefix-cache-producer"})
RENAMES = (
    _Rename(
        frozenset({"token-producer", "tokenizer"}), ("vllm", "http"), ("vllm", "url"), "llm-d-router v0.9.0"
    ),
    _Rename(
        _PRECISE,
        ("indexerConfig", "tokenProcessorConfig"),
        ("tokenProcessorConfig",),
        "llm-d-kv-cache #236, llm-d-router v0.10.0",
    ),
    _Rename(
        _APPROX,
        ("hashBlockSize",),
        ("blockSize",),
        "gateway-api-inference-extension #1613",
        "a size in characters; `blockSize` is deprecated in turn: set `blockSizeTokens` (tokens, about 4 "
        "characters each) instead",
    ),
    _Rename(
        _PRECISE,
        ("indexerConfig", "kvBlockIndexConfig", "maxPrefixBlocksToMatch"),
        (),
        "",
        "not a parameter of llm-d-router's precise index, which has no replacement for it (the matcher "
        "walks the prompt's whole block chain): remove it",
    ),
)


def migrate_renamed(ctx: LoadContext, strict: bool) -> None:
    """Move every old parameter name of ``RENAMES`` to its new place (or refuse it when ``strict``)."""
    for spec in ctx.doc.plugins:
        if not isinstance(spec.parameters, dict):
            continue
        for rename in RENAMES:
            if spec.type in rename.types:
                _migrate(ctx, spec, spec.parameters, rename, strict)


def _migrate(ctx: LoadContext, spec: PluginSpec, params: dict[str, Any], r: _Rename, strict: bool) -> None:
    parent = _lookup(params, r.old[:-1])
    if parent is None or r.old[-1] not in parent:
        return
    old = ".".join(r.old)
    new = ".".join(r.new)
    where = f"{spec.path}.parameters.{old}"
    if not r.new:
        raise ConfigError(where, f"unknown parameter (`{old}` is {r.refuse})")
    reason = f"`{old}` was replaced by `{new}` in {r.since}"
    if r.refuse:
        raise ConfigError(where, f"unknown parameter ({reason}: {r.refuse})")
    if strict:
        raise ConfigError(where, f"unknown parameter ({reason})")
    target = params
    for key in r.new[:-1]:
        child = target.get(key)
        if child is None:
            child = target[key] = {}
        if not isinstance(child, dict):
            return  # the decoder reports the bad type at its own field
        target = child
    if r.new[-1] in target:
        raise ConfigError(where, f"both `{old}` and `{new}` are set ({reason}): keep `{new}` only")
    target[r.new[-1]] = parent.pop(r.old[-1])
    ctx.warnings.append(f"{where}: deprecated, {reason}; loaded as `{new}`")


def _lookup(params: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    node: Any = params
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None
