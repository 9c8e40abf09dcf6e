"""``python -m epp.dev.envoy``: see :mod:`epp.dev.envoy.cli`."""

import sys

from epp.dev.envoy.cli import main

sys.exit(main())
