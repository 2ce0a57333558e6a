"""The operations HTTP endpoint: Prometheus metrics and health probes (``metrics``), the bounded
HTTP server under it (``server``) and the exporter that reads the stats at scrape time
(``exporter``). No rows are served here.
"""
