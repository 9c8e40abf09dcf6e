"""Prometheus metrics of ``file-discovery`` (kept with the plugin that records them)."""

from __future__ import annotations

from epp import promlite

LOAD_FAILURE_REASONS = (
    "read_error",  # missing, unreadable
    "too_large",  # over 1 MiB
    "parse_error",  # not valid YAML / JSON
    "invalid_shape",  # the top level is not a mapping, or 'endpoints' is not a list
    "no_valid_entries",  # entries listed, none of them valid
)

FILE_LOAD_FAILURES = promlite.Counter(
    "llm_d_epp_discovery_file_load_failures_total",
    "Rejected loads of the endpoints file (the last good endpoint set stays) by reason.",
    ["reason"],
)
FILE_REJECTED = promlite.Gauge(
    "llm_d_epp_discovery_file_rejected",
    "1 while the endpoints file on disk is rejected and the last good endpoint set is served.",
)
FILE_INVALID_ENTRIES = promlite.Gauge(
    "llm_d_epp_discovery_file_invalid_entries",
    "Invalid entries in the last endpoints file parsed.",
)
promlite.register(FILE_LOAD_FAILURES, FILE_REJECTED, FILE_INVALID_ENTRIES, owners=("file-discovery",))
for _reason in LOAD_FAILURE_REASONS:
    FILE_LOAD_FAILURES.labels(_reason)
FILE_REJECTED.labels().set(0)
FILE_INVALID_ENTRIES.labels().set(0)
