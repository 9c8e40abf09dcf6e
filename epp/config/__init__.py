"""Loading ``EndpointPickerConfig`` files into the runtime objects of the EPP.

``load_config(text)`` returns a ``LoadedConfig``; a problem raises ``ConfigError(field, reason)``
naming the offending element by its dotted path; several independent problems raise ``ConfigErrors``
(a ``ConfigError`` carrying the first one's field and reason, and ``errors``, all of them).
"""

from epp.config.defaults import default_document
from epp.config.loader import LoadedConfig, load_config, load_config_file, load_document
from epp.config.schema import ConfigDocument, ConfigSyntaxError
from epp.framework.errors import ConfigError, ConfigErrors

__all__ = [
    "ConfigDocument",
    "ConfigError",
    "ConfigErrors",
    "ConfigSyntaxError",
    "LoadedConfig",
    "default_document",
    "load_config",
    "load_config_file",
    "load_document",
]
