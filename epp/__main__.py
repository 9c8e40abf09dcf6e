"""``python -m epp``: the ``epp`` command."""

from epp.cli import main

raise SystemExit(main())
