"""Loading ``EndpointPickerConfig`` files into the runtime objects of the EPP.

``load_config(text)`` returns a ``LoadedConfig``; every problem raises ``ConfigError(field, reason)``
naming the offending element by its dotted path.
"""

from epp.config.defaults import default_document
from epp.config.loader import LoadedConfig, load_config, load_config_file, load_document
from epp.config.schema import ConfigDocument, ConfigSyntaxError
from epp.framework.errors import ConfigError

__all__ = [
    "ConfigDocument",
    "ConfigError",
    "ConfigSyntaxError",
    "LoadedConfig",
    "default_document",
    "load_config",
    "load_config_file",
    "load_document",
]
