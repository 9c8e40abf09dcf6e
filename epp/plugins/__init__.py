"""Built-in plugins. Importing this package registers every built-in type.

One plugin per module; parameters and algorithms are described in docs/plugins.md.
"""

from epp.plugins.deciders import always_disagg as always_disagg
from epp.plugins.deciders import multimodal as multimodal
from epp.plugins.deciders import prefix_based as prefix_based
from epp.plugins.discovery import file_discovery as file_discovery
from epp.plugins.discovery import multicluster_file_discovery as multicluster_file_discovery
from epp.plugins.filters import by_label as by_label
from epp.plugins.filters import decode_filter as decode_filter
from epp.plugins.filters import encode_filter as encode_filter
from epp.plugins.filters import endpoint_attribute_filter as endpoint_attribute_filter
from epp.plugins.filters import header_based_testing as header_based_testing
from epp.plugins.filters import label_selector as label_selector
from epp.plugins.filters import lora_residency_filter as lora_residency_filter
from epp.plugins.filters import multicluster_session_affinity_filter as multicluster_session_affinity_filter
from epp.plugins.filters import prefill_filter as prefill_filter
from epp.plugins.filters import prefix_cache_affinity as prefix_cache_affinity
from epp.plugins.filters import session_affinity_filter as session_affinity_filter
from epp.plugins.filters import slo_headroom_tier as slo_headroom_tier
from epp.plugins.filters import topology_affinity_filter as topology_affinity_filter
from epp.plugins.filters import utilization_filter as utilization_filter
from epp.plugins.flow_control import edf as edf
from epp.plugins.flow_control import fair_share as fair_share
from epp.plugins.flow_control import fcfs as fcfs
from epp.plugins.flow_control import global_strict as global_strict
from epp.plugins.flow_control import priority_holdback as priority_holdback
from epp.plugins.flow_control import program_aware as program_aware
from epp.plugins.flow_control import round_robin as round_robin
from epp.plugins.flow_control import slo_deadline as slo_deadline
from epp.plugins.flow_control import soft_reflective_ceiling as soft_reflective_ceiling
from epp.plugins.flow_control import static_usage_limit as static_usage_limit
from epp.plugins.parsers import anthropic as anthropic
from epp.plugins.parsers import openai as openai
from epp.plugins.parsers import passthrough as passthrough
from epp.plugins.parsers import sglanghttp as sglanghttp
from epp.plugins.parsers import vertexai as vertexai
from epp.plugins.parsers import vllmgrpc as vllmgrpc
from epp.plugins.parsers import vllmhttp as vllmhttp
from epp.plugins.pickers import max_score, random_picker
from epp.plugins.pickers import weighted_random as weighted_random
from epp.plugins.producers import approx_prefix_cache as approx_prefix_cache
from epp.plugins.producers import burst_prefix_cache as burst_prefix_cache
from epp.plugins.producers import inflight_load as inflight_load
from epp.plugins.producers import mm_embeddings_cache as mm_embeddings_cache
from epp.plugins.producers import multicluster_approx_prefix_cache as multicluster_approx_prefix_cache
from epp.plugins.producers import precise_prefix_cache as precise_prefix_cache
from epp.plugins.producers import predicted_latency as predicted_latency
from epp.plugins.producers import session_id as session_id
from epp.plugins.producers import session_state as session_state
from epp.plugins.producers import token_producer as token_producer
from epp.plugins.profile_handlers import data_parallel as data_parallel
from epp.plugins.profile_handlers import disagg as disagg
from epp.plugins.profile_handlers import disagg_headers as disagg_headers
from epp.plugins.profile_handlers import header_profile as header_profile
from epp.plugins.profile_handlers import pd_legacy as pd_legacy
from epp.plugins.profile_handlers import single
from epp.plugins.request_control import agent_identity as agent_identity
from epp.plugins.request_control import disaggregatedset_rollout_screener as disaggregatedset_rollout_screener
from epp.plugins.request_control import endpoint_health_filter as endpoint_health_filter
from epp.plugins.request_control import latency_slo_admitter as latency_slo_admitter
from epp.plugins.request_control import models_responder as models_responder
from epp.plugins.request_control import outlen_bucket as outlen_bucket
from epp.plugins.request_control import probabilistic_admitter as probabilistic_admitter
from epp.plugins.request_control import request_attribute_reporter as request_attribute_reporter
from epp.plugins.saturation import concurrency_detector as concurrency_detector
from epp.plugins.saturation import utilization_detector as utilization_detector
from epp.plugins.scorers import active_request as active_request
from epp.plugins.scorers import context_length_aware as context_length_aware
from epp.plugins.scorers import endpoint_attribute_scorer as endpoint_attribute_scorer
from epp.plugins.scorers import header_label_affinity as header_label_affinity
from epp.plugins.scorers import kv_cache_utilization, queue
from epp.plugins.scorers import latency as latency
from epp.plugins.scorers import load_aware as load_aware
from epp.plugins.scorers import lora_affinity as lora_affinity
from epp.plugins.scorers import lora_load_state as lora_load_state
from epp.plugins.scorers import mm_embeddings_cache_scorer as mm_embeddings_cache_scorer
from epp.plugins.scorers import multicluster_kv_cache_utilization as multicluster_kv_cache_utilization
from epp.plugins.scorers import multicluster_prefix_cache as multicluster_prefix_cache
from epp.plugins.scorers import multicluster_queue as multicluster_queue
from epp.plugins.scorers import no_hit_lru as no_hit_lru
from epp.plugins.scorers import prefill_cost as prefill_cost
from epp.plugins.scorers import prefix_cache as prefix_cache
from epp.plugins.scorers import prefix_spread as prefix_spread
from epp.plugins.scorers import running_requests_size as running_requests_size
from epp.plugins.scorers import session_affinity as session_affinity
from epp.plugins.scorers import token_load as token_load
from epp.plugins.scorers import topology_affinity_scorer as topology_affinity_scorer
from epp.plugins.scraping import core_metrics_extractor as core_metrics_extractor
from epp.plugins.scraping import dcgm_data_source as dcgm_data_source
from epp.plugins.scraping import dcgm_extractor as dcgm_extractor
from epp.plugins.scraping import endpoint_notification_source as endpoint_notification_source
from epp.plugins.scraping import k8s_notification_source as k8s_notification_source
from epp.plugins.scraping import metrics_data_source as metrics_data_source
from epp.plugins.scraping import models_data_extractor as models_data_extractor
from epp.plugins.scraping import models_data_source as models_data_source
from epp.plugins.scraping import multicluster_metrics_data_source as multicluster_metrics_data_source
from epp.plugins.scraping import multicluster_metrics_extractor as multicluster_metrics_extractor
from epp.plugins.scraping import topology_extractor as topology_extractor
from epp.plugins.scraping import zmq_metrics_data_source as zmq_metrics_data_source
from epp.plugins.scraping import zmq_state_extractor as zmq_state_extractor
from epp.plugins.syncers import redis_syncer as redis_syncer

__all__ = ["kv_cache_utilization", "max_score", "queue", "random_picker", "single"]
