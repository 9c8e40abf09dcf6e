"""Built-in plugins. Importing this package registers every built-in type.

One plugin per module; each module's docstring states its type name, parameters and algorithm.
"""

from epp.plugins.pickers import max_score, random_picker
from epp.plugins.profile_handlers import single
from epp.plugins.scorers import kv_cache_utilization, queue

__all__ = ["kv_cache_utilization", "max_score", "queue", "random_picker", "single"]
