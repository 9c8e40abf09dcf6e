"""Parameters shared by every picker."""

from __future__ import annotations

import random
from dataclasses import dataclass

# One generator for all pickers; seeded from the OS. Tests may reseed it.
rng = random.Random()


@dataclass(slots=True, frozen=True)
class PickerParams:
    """``maxNumOfEndpoints`` (default 1; values <= 0 mean 1): how many endpoints to return.

    More than one yields a comma-joined fallback list, which Envoy's ORIGINAL_DST cluster cannot
    parse (it answers 503): only use it with a proxy that implements GIE fallback lists.
    """

    max_num_of_endpoints: int = 1

    @property
    def k(self) -> int:
        return self.max_num_of_endpoints if self.max_num_of_endpoints > 0 else 1
