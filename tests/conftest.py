"""Collection of the whole test tree: tests/engines (real vLLM engines, minutes) only under
``make test-engines`` (``EPP_ENGINE_TESTS=1``), never in ``make test``."""

import os

collect_ignore = [] if os.environ.get("EPP_ENGINE_TESTS") else ["engines"]
