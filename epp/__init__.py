"""epp: a Python Endpoint Picker for LLM inference behind Envoy (Gateway API Inference Extension)."""

__version__ = "0.1.0"
