"""Wire names: the HTTP headers and Envoy metadata namespaces and keys the EPP reads or writes.

Every module that puts one of these names on the wire imports it from here, so a name is spelled
once. Header names are lower case (Envoy's ext_proc sends them so).
"""

from __future__ import annotations

from typing import Final

# Routing: EPP -> Envoy.
DESTINATION_HEADER: Final = "x-gateway-destination-endpoint"
# epp's fail-over endpoint: the generated Envoy bootstraps send the one retry of a request whose
# engine could not be reached there (an ORIGINAL_DST cluster cannot walk a GIE endpoint list).
FALLBACK_HEADER: Final = "x-epp-fallback-endpoint"
"""The picked endpoint (``ip:port``), as a request header and as a key of ``LB_NAMESPACE``."""
DESTINATION_SERVED_HEADER: Final = "x-gateway-destination-endpoint-served"
LB_NAMESPACE: Final = "envoy.lb"
"""The dynamic metadata namespace of the routing reply."""
SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
"""The filter metadata namespace of the subset hint (Envoy -> EPP)."""
SUBSET_KEY: Final = "x-gateway-destination-endpoint-subset"
"""The subset hint's key in ``SUBSET_NAMESPACE``; also a request header only the EPP may write."""

POOL_METADATA_KEY: Final = "x-epp-pool"
"""The pool a route is for: gRPC metadata on the ext_proc stream (Envoy's per-route
``grpc_initial_metadata``); a request header of that name from a client is never honoured."""
POOL_LABEL: Final = "epp.llm-d.ai/pool"
"""The endpoint label by which file discovery groups endpoints into pools."""

# Request headers the EPP reads.
REQUEST_ID_HEADER: Final = "x-request-id"
OBJECTIVE_HEADER: Final = "x-gateway-inference-objective"
LLM_D_OBJECTIVE_HEADER: Final = "x-llm-d-inference-objective"
OBJECTIVE_HEADERS: Final = (LLM_D_OBJECTIVE_HEADER, OBJECTIVE_HEADER)
"""The InferenceObjective a request names, the current name first."""
FAIRNESS_HEADER: Final = "x-gateway-inference-fairness-id"
LLM_D_FAIRNESS_HEADER: Final = "x-llm-d-inference-fairness-id"
FAIRNESS_HEADERS: Final = (LLM_D_FAIRNESS_HEADER, FAIRNESS_HEADER)
"""The request's fairness id (its flow), the current name first."""
DEFAULT_FAIRNESS_ID: Final = "default-flow"
"""The fairness id of a request without a fairness header."""
MODEL_REWRITE_HEADER: Final = "x-gateway-model-name-rewrite"
LLM_D_MODEL_REWRITE_HEADER: Final = "x-llm-d-model-name-rewrite"
MODEL_REWRITE_HEADERS: Final = (LLM_D_MODEL_REWRITE_HEADER, MODEL_REWRITE_HEADER)
"""A client's model rewrite, the current name first."""
REWRITE_METADATA_KEY: Final = MODEL_REWRITE_HEADER
"""The ``LB_NAMESPACE`` key of a model-rewritten request: {"incoming": asked for, "target": served}."""
SLO_TTFT_HEADER: Final = "x-slo-ttft-ms"
LLM_D_SLO_TTFT_HEADER: Final = "x-llm-d-slo-ttft-ms"
SLO_TTFT_HEADERS: Final = (LLM_D_SLO_TTFT_HEADER, SLO_TTFT_HEADER)
"""The request's time-to-first-token objective in milliseconds, the current name first."""
SLO_TPOT_HEADER: Final = "x-slo-tpot-ms"
LLM_D_SLO_TPOT_HEADER: Final = "x-llm-d-slo-tpot-ms"
SLO_TPOT_HEADERS: Final = (LLM_D_SLO_TPOT_HEADER, SLO_TPOT_HEADER)
"""The request's time-per-output-token objective in milliseconds, the current name first."""
ORIGINAL_PATH_HEADER: Final = "x-original-path"
FORWARDED_PATH_HEADER: Final = "x-forwarded-path"
SESSION_TOKEN_HEADER: Final = "x-session-token"
"""Session affinity: request and response header carrying the serving endpoint's token."""
TEST_ENDPOINT_SELECTION_HEADER: Final = "test-epp-endpoint-selection"

# Request headers plugins write for the model server.
PREFILL_HEADER: Final = "x-prefiller-host-port"
ENCODERS_HEADER: Final = "x-encoder-hosts-ports"
DATA_PARALLEL_HEADER: Final = "x-data-parallel-host-port"

# Response headers.
DEBUG_RESPONSE_HEADER: Final = "x-went-into-resp-headers"
REQUEST_DROPPED_REASON_HEADER: Final = "x-llm-d-request-dropped-reason"
"""On a rejection: why the EPP dropped the request (``epp.framework.errors.DroppedReason``)."""
ENDPOINT_SCORES_KEY: Final = "x-gateway-destination-endpoint-scores"
"""``LB_NAMESPACE`` key of the candidates' scores (``epp serve --emit-endpoint-scores``)."""

# Request headers describing a request's videos (multimodal placeholder estimation).
VIDEO_DURATION_HEADER: Final = "x-llm-d-video-duration-seconds"
VIDEO_RESOLUTION_HEADER: Final = "x-llm-d-video-resolution"
VIDEO_FPS_HEADER: Final = "x-llm-d-video-fps"

# Pod labels.
ENGINE_TYPE_LABEL: Final = "llm-d.ai/engine-type"
"""The model server's engine (``vllm``, ``sglang``, ...)."""
LEGACY_ENGINE_TYPE_LABEL: Final = "inference.networking.k8s.io/engine-type"
