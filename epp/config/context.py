"""The state the loading phases share: the document, the plugin instances, warnings, errors.

Every ``plugins:`` entry is checked first (type registered, name unique, stability allowed), then
created in list order; a factory that asks the handle for another declared plugin gets it created
on demand, whatever its place in the list, so dependencies are always created first. A reference
cycle is an error naming the loop. System defaults are appended to the document under their type
name.

Errors are collected, not raised at the first: each plugin that fails is recorded in ``failed`` and
its error in ``errors``; a later reference to it (from a factory, a profile or a section) raises
``DependentError``, which is not reported again, so one root cause gives one error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from epp.config.schema import ConfigDocument, PluginSpec
from epp.framework import registry
from epp.framework.endpoint import Endpoint
from epp.framework.errors import ConfigError, ConfigErrors
from epp.framework.interfaces import Plugin, Stability
from epp.framework.params import decode_params

EndpointsFn = Callable[[], Sequence[Endpoint]]

ALLOW_EXPERIMENTAL_FLAG = "--allow-experimental-plugins"


class PluginLoadError(ConfigError):
    """A plugin could not be created; already names that plugin, so the factories of plugins that
    asked for it on demand pass it on unchanged."""


class PluginCycleError(PluginLoadError):
    """Plugins that reference each other in a loop."""


class DependentError(PluginLoadError):
    """Follows from an error already reported (a reference to a plugin that failed to load): it
    stops what depends on that plugin and is not reported again."""


_T = TypeVar("_T")


class _Handle:
    """The factory handle: any declared plugin (created on demand) and the live endpoints."""

    __slots__ = ("_ctx", "_endpoints")

    def __init__(self, ctx: LoadContext, endpoints: EndpointsFn) -> None:
        self._ctx = ctx
        self._endpoints = endpoints

    def plugin(self, name: str) -> Plugin | None:
        return self._ctx.resolve_dependency(name)

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

    __slots__ = (
        "_creating",
        "allow_experimental",
        "dependencies",
        "doc",
        "environ",
        "errors",
        "failed",
        "handle",
        "plugins",
        "source",
        "specs",
        "warnings",
    )

    def __init__(
        self,
        doc: ConfigDocument,
        source: str,
        endpoints: EndpointsFn | None,
        environ: Mapping[str, str],
        *,
        allow_experimental: bool = True,
    ) -> None:
        self.doc = doc
        self.source = source
        self.environ = environ
        self.allow_experimental = allow_experimental
        self.warnings: list[str] = []
        self.errors: list[ConfigError] = []  # in the order found; the first is what one error said
        # plugins that did not load: name -> type
        self.failed: dict[str, type[Plugin] | None] = {
            name: registry.lookup(type_name) for name, type_name in doc.invalid_plugins.items()
        }
        self.plugins: dict[str, Plugin] = {}
        self.dependencies: set[str] = set()  # plugins another plugin's factory asked for
        self.specs: dict[str, PluginSpec] = {}
        self._creating: list[str] = []  # names under construction, outermost first
        self.handle = _Handle(self, endpoints or _no_endpoints)

    # --- the plugins: section ----------------------------------------------------------------------

    # --- errors ------------------------------------------------------------------------------------

    def report(self, error: ConfigError) -> None:
        """Record ``error`` (each of a ``ConfigErrors``); a ``DependentError`` is already reported."""
        if isinstance(error, ConfigErrors):
            for e in error.errors:
                self.report(e)
        elif not isinstance(error, DependentError) and not any(
            e.field == error.field and e.reason == error.reason for e in self.errors
        ):
            self.errors.append(error)

    def attempt(self, phase: Callable[..., _T], *args: Any) -> _T | None:
        """Run one loading phase; its ``ConfigError`` is recorded and None returned.

        Once an error is recorded, a later phase works on an incomplete configuration (plugins
        missing): any failure of it is taken as a consequence of the errors already recorded.
        """
        earlier = bool(self.errors)
        try:
            return phase(*args)
        except ConfigError as e:
            self.report(e)
        except Exception:
            if not earlier:
                raise
        return None

    def raise_errors(self) -> None:
        """Raise what was recorded: the one error itself, or a ``ConfigErrors`` of them all."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise ConfigErrors(self.errors)

    # --- the plugins: section ----------------------------------------------------------------------

    def instantiate_all(self, forbidden_type: str = "", forbidden_why: str = "") -> None:
        """Check every declared plugin, then create them (dependencies first); ``plugins`` keeps
        declaration order. ``forbidden_type`` is refused with ``forbidden_why``. Every plugin that
        fails is reported and left out."""
        for spec in self.doc.plugins:
            if spec.name in self.failed:
                continue  # refused before (epp.config.removed), already reported
            try:
                self._check_spec(spec, forbidden_type, forbidden_why)
            except ConfigError as e:
                self.report(e)
                if spec.name not in self.specs:
                    self.failed[spec.name] = registry.lookup(spec.type)
                continue
            self.specs[spec.name] = spec
        for spec in self.doc.plugins:
            if spec.name in self.failed or spec.name in self.plugins:
                continue
            try:
                self.resolve(spec.name)
            except ConfigError as e:
                self.report(e)
        ordered = {
            spec.name: self.plugins[spec.name] for spec in self.doc.plugins if spec.name in self.plugins
        }
        self.plugins.clear()
        self.plugins.update(ordered)

    def resolve(self, name: str) -> Plugin | None:
        """The plugin declared as ``name``, created now if it was not yet; None if undeclared.

        A plugin that failed to load raises ``DependentError``."""
        plugin = self.plugins.get(name)
        if plugin is not None:
            return plugin
        if name in self.failed:
            raise DependentError(self._where(name), f"plugin '{name}' failed to load")
        spec = self.specs.get(name)
        if spec is None:
            return None
        if name in self._creating:
            loop = [*self._creating[self._creating.index(name) :], name]
            raise PluginCycleError(
                self.specs[loop[0]].path,
                f"plugins reference each other in a loop: {' -> '.join(loop)}",
            )
        return self._create(spec)

    def resolve_dependency(self, name: str) -> Plugin | None:
        """``resolve`` for a factory asking for another plugin: a failure of that plugin is reported
        here, once, and the asking plugin fails with a ``DependentError``."""
        self.dependencies.add(name)
        try:
            return self.resolve(name)
        except DependentError:
            raise
        except ConfigError as e:
            self.report(e)
            raise DependentError(e.field, e.reason) from e

    def plugin_warnings(self) -> None:
        """Each plugin's ``config_warnings``, prefixed with the field path of its parameters."""
        for name, plugin in self.plugins.items():
            spec = self.specs.get(name)
            path = spec.path if spec is not None else "plugins"
            for where, reason in plugin.config_warnings(self.plugins):
                field = f"{path}.parameters.{where}" if where else path
                self.warnings.append(f"{field}: plugin '{name}' ({plugin.type_name}): {reason}")

    def get(self, name: str) -> Plugin | None:
        """The loaded plugin ``name`` (None if undeclared); one that failed raises ``DependentError``."""
        plugin = self.plugins.get(name)
        if plugin is None and name in self.failed:
            raise DependentError(self._where(name), f"plugin '{name}' failed to load")
        return plugin

    def _where(self, name: str) -> str:
        spec = self.specs.get(name)
        return spec.path if spec is not None else "plugins"

    def _check_spec(self, spec: PluginSpec, forbidden_type: str, forbidden_why: str) -> None:
        if not spec.type:
            raise ConfigError(f"{spec.path}.type", f"plugin '{spec.name}' is missing a type")
        if spec.name in self.specs:
            raise ConfigError(f"{spec.path}.name", f"duplicate plugin name '{spec.name}'")
        cls = registry.lookup(spec.type)
        if cls is None:
            hint = registry.suggest(spec.type)
            more = f"; did you mean '{hint}'?" if hint else " (`epp plugins` lists the registered types)"
            raise ConfigError(f"{spec.path}.type", f"plugin type '{spec.type}' is not registered{more}")
        if forbidden_type and cls.type_name == forbidden_type:
            raise ConfigError(f"{spec.path}.type", f"{forbidden_type} is not allowed {forbidden_why}")
        if cls.stability is Stability.ALPHA and not self.allow_experimental:
            raise ConfigError(
                f"{spec.path}.type",
                f"plugin '{spec.name}' (type: '{spec.type}') has Alpha stability level, but command "
                f"line flag {ALLOW_EXPERIMENTAL_FLAG} is not set (pass {ALLOW_EXPERIMENTAL_FLAG}=true "
                "to load it)",
            )
        warning = registry.deprecation_warning_once(spec.type)
        if warning:
            self.warnings.append(f"{spec.path}.type: {warning}")

    def _create(self, spec: PluginSpec) -> Plugin:
        cls = registry.lookup(spec.type)
        assert cls is not None  # checked by _check_spec
        try:
            params = decode_params(cls.Params, spec.parameters, f"{spec.path}.parameters")
        except ConfigError as e:
            self.failed[spec.name] = cls
            raise PluginLoadError(e.field, e.reason) from e
        self._creating.append(spec.name)
        try:
            plugin = cls(spec.name, params, self.handle)
        except PluginLoadError:
            self.failed[spec.name] = cls
            raise
        except (ConfigError, ValueError) as e:
            self.failed[spec.name] = cls
            wrapped = _factory_error(spec, e)
            raise PluginLoadError(wrapped.field, wrapped.reason) from e
        finally:
            self._creating.pop()
        self.plugins[spec.name] = plugin
        return plugin

    # --- system defaults and references ------------------------------------------------------------

    def add_default(self, type_name: str, what: str, parameters: dict[str, Any] | None = None) -> Plugin:
        """Instantiate a system default named after its type and append it to ``plugins``."""
        if registry.lookup(type_name) is None:
            raise ConfigError(
                "plugins", f"failed to apply {what} defaults: plugin type '{type_name}' not found in registry"
            )
        spec = PluginSpec(
            type=type_name, name=type_name, parameters=parameters, path=f"plugins[{len(self.doc.plugins)}]"
        )
        if spec.name in self.failed:  # a declared plugin of that name failed: no second error
            raise DependentError(self._where(spec.name), f"plugin '{spec.name}' failed to load")
        if spec.name in self.specs:
            raise ConfigError(f"{spec.path}.name", f"duplicate plugin name '{spec.name}'")
        self.doc.plugins.append(spec)
        self.specs[spec.name] = spec
        try:
            return self._create(spec)
        except ConfigError as e:
            raise ConfigError(
                e.field, f"failed to instantiate default plugin '{type_name}': {e.reason}"
            ) from e

    def lookup_ref(self, ref: str, where: str, what: str) -> Plugin:
        """The plugin a ``pluginRef`` names; empty or undefined references are errors at ``where``."""
        if not ref:
            raise ConfigError(where, f"{what} plugin reference is empty")
        plugin = self.get(ref)
        if plugin is None:
            raise ConfigError(where, f"references undefined plugin '{ref}'{self.did_you_mean(ref)}")
        return plugin

    def did_you_mean(self, ref: str) -> str:
        """``"; did you mean 'x'?"`` for the declared plugin name closest to ``ref``, else ``""``."""
        hint = registry.closest(ref, list(self.plugins))
        return f"; did you mean '{hint}'?" if hint else ""
