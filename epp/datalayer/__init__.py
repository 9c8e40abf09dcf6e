"""The data layer: the endpoint store, metrics scraping, freshness and pool gauges.

Submodules are imported explicitly (nothing is re-exported here) so that importing the store does
not pull in the HTTP machinery.
"""
