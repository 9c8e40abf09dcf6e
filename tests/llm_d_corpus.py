"""Where the reference's EndpointPickerConfig files are: data from outside the project, read from
``../shared/reference/llm-d-configs`` next to the project's root; tests skip, saying why, without it.

``EXPECTED`` (tests/data/llm_d_configs/EXPECTED.yaml, the project's own) says what each file does in
epp, keyed by its path under that folder without ``.yaml``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "reference" / "llm-d-configs"
EXPECTED_FILE = ROOT / "tests" / "data" / "llm_d_configs" / "EXPECTED.yaml"
EXPECTED: dict[str, Any] = yaml.safe_load(EXPECTED_FILE.read_text())
PRESENT = (CORPUS / "project-corpus").is_dir()
MISSING = f"the reference's config files are not here: {CORPUS} is absent (see tests/llm_d_corpus.py)"

# Every test of a module that reads the corpus: ``pytestmark = needs_corpus``.
needs_corpus = pytest.mark.skipif(not PRESENT, reason=MISSING)


def config_path(key: str) -> Path:
    """The file of an EXPECTED key (``project-corpus/precise-prefix``, ``head/expected-invalid/...``)."""
    return CORPUS / f"{key}.yaml"


def project_config(name: str) -> Path:
    """A file of ``project-corpus/`` (the names of the former tests/data/llm_d_configs)."""
    return config_path(f"project-corpus/{name}")


def corpus_keys() -> list[str]:
    """The key of every ``*.yaml`` under the corpus (Helm values files are not configs)."""
    return sorted(str(p.relative_to(CORPUS))[: -len(".yaml")] for p in CORPUS.rglob("*.yaml"))
