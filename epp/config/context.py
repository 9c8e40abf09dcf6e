"""The state the loading phases share: the document, the plugin instances so far, warnings.

Plugins are instantiated in ``plugins:`` order (a factory sees those declared before it); system
defaults are appended to the document under their type name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from epp.config.schema import ConfigDocument, PluginSpec
from epp.framework import registry
from epp.framework.endpoint import Endpoint
from epp.framework.errors import ConfigError
from epp.framework.interfaces import Plugin
from epp.framework.params import decode_params

EndpointsFn = Callable[[], Sequence[Endpoint]]


class _Handle:
    """The factory handle: plugins created so far (i.e. declared earlier) and the live endpoints."""

    __slots__ = ("_endpoints", "_plugins")

    def __init__(self, plugins: Mapping[str, Plugin], endpoints: EndpointsFn) -> None:
        self._plugins = plugins
        self._endpoints = endpoints

    def plugin(self, name: str) -> Plugin | None:
        return self._plugins.get(name)

    def endpoints(self) -> Sequence[Endpoint]:
        return self._endpoints()


def _no_endpoints() -> Sequence[Endpoint]:
    return ()


def _factory_error(spec: PluginSpec, exc: Exception) -> ConfigError:
    """Wrap a factory failure so that the field names the plugin.

    A ``ConfigError`` raised by a factory names its field relative to the plugin's ``parameters``
    (``deciders.prefill``), unless it already is a full path (``plugins[...]``) or is empty.
    """
    prefix = f"failed to create plugin '{spec.name}' (type: {spec.type})"
    if isinstance(exc, ConfigError):
        if not exc.field:
            where = spec.path
        elif exc.field.startswith("plugins["):
            where = exc.field
        else:
            where = f"{spec.path}.parameters.{exc.field}"
        return ConfigError(where, f"{prefix}: {exc.reason}")
    return ConfigError(spec.path, f"{prefix}: {exc}")


class LoadContext:
    """One configuration being loaded: ``plugins`` and ``specs`` by name, in ``plugins:`` order."""

    __slots__ = ("doc", "environ", "handle", "plugins", "source", "specs", "warnings")

    def __init__(
        self, doc: ConfigDocument, source: str, endpoints: EndpointsFn | None, environ: Mapping[str, str]
    ) -> None:
        self.doc = doc
        self.source = source
        self.environ = environ
        self.warnings: list[str] = []
        self.plugins: dict[str, Plugin] = {}
        self.specs: dict[str, PluginSpec] = {}
        self.handle = _Handle(self.plugins, endpoints or _no_endpoints)

    def instantiate(self, spec: PluginSpec, forbidden_type: str = "", forbidden_why: str = "") -> Plugin:
        """Decode ``spec``'s parameters and create the plugin; ``forbidden_type`` is refused."""
        if not spec.type:
            raise ConfigError(f"{spec.path}.type", f"plugin '{spec.name}' is missing a type")
        if spec.name in self.plugins:
            raise ConfigError(f"{spec.path}.name", f"duplicate plugin name '{spec.name}'")
        cls = registry.lookup(spec.type)
        if cls is None:
            raise ConfigError(f"{spec.path}.type", f"plugin type '{spec.type}' is not registered")
        if forbidden_type and cls.type_name == forbidden_type:
            raise ConfigError(f"{spec.path}.type", f"{forbidden_type} is not allowed {forbidden_why}")
        params = decode_params(cls.Params, spec.parameters, f"{spec.path}.parameters")
        try:
            plugin = cls(spec.name, params, self.handle)
        except (ConfigError, ValueError) as e:
            raise _factory_error(spec, e) from e
        self.plugins[spec.name] = plugin
        self.specs[spec.name] = spec
        return plugin

    def add_default(self, type_name: str, what: str, parameters: dict[str, Any] | None = None) -> Plugin:
        """Instantiate a system default named after its type and append it to ``plugins``."""
        if registry.lookup(type_name) is None:
            raise ConfigError(
                "plugins", f"failed to apply {what} defaults: plugin type '{type_name}' not found in registry"
            )
        spec = PluginSpec(
            type=type_name, name=type_name, parameters=parameters, path=f"plugins[{len(self.doc.plugins)}]"
        )
        self.doc.plugins.append(spec)
        try:
            return self.instantiate(spec)
        except ConfigError as e:
            raise ConfigError(
                e.field, f"failed to instantiate default plugin '{type_name}': {e.reason}"
            ) from e

    def lookup_ref(self, ref: str, where: str, what: str) -> Plugin:
        """The plugin a ``pluginRef`` names; empty or undefined references are errors at ``where``."""
        if not ref:
            raise ConfigError(where, f"{what} plugin reference is empty")
        plugin = self.plugins.get(ref)
        if plugin is None:
            raise ConfigError(where, f"references undefined plugin '{ref}'")
        return plugin
