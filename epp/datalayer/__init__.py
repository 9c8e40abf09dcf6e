"""The data layer: the endpoint store, metrics scraping and pool gauges.

* ``store``: ``EndpointStore``, where discovery writes endpoints and the scheduler reads them;
* ``promtext``: targeted extraction of metric values from Prometheus text exposition;
* ``scraper``: ``MetricsScraper``, one polling task per endpoint feeding ``Endpoint.metrics`` (and
  how long each snapshot is trusted, ``Metrics.fresh_until``);
* ``freshness``: the ``llm_d_epp_datalayer_*`` gauges and counter of metrics states and failures;
* ``pool_gauges``: ``PoolGaugeReporter``, the periodic ``inference_pool_*`` gauges.

Submodules are imported explicitly (nothing is re-exported here) so that importing the store does
not pull in the HTTP machinery.
"""
