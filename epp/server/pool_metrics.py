"""Request metrics by pool (an EPP serving several InferencePools): shown when it may serve several.

``llm_d_epp_pool_request_total{inference_pool}`` counts the requests each pool was chosen for;
``llm_d_epp_pool_request_error_total{inference_pool,error_code}`` their errors, and with
``inference_pool=""`` the requests that matched no pool (404).
"""

from __future__ import annotations

from epp import promlite

OWNER = "inference-pools"

POOL_REQUEST_TOTAL = promlite.Counter(
    "llm_d_epp_pool_request_total",
    "[ALPHA] Requests per InferencePool (an EPP serving several pools).",
    ["inference_pool"],
)
POOL_REQUEST_ERROR_TOTAL = promlite.Counter(
    "llm_d_epp_pool_request_error_total",
    '[ALPHA] Request errors per InferencePool; inference_pool="": the request matched no pool.',
    ["inference_pool", "error_code"],
)
promlite.register(POOL_REQUEST_TOTAL, POOL_REQUEST_ERROR_TOTAL, owners=(OWNER,))
