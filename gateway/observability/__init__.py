"""What the gateway tells operators: the request record and access log (`record`, `logs`), Prometheus
metrics (`metrics`), OpenTelemetry spans (`tracing`) and the status page's window (`status`). Only the
dispatch ledger (gateway/dispatch/ledger.py) writes a request's record, metrics and spans."""
