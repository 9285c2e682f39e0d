"""Flow control (issue 39): while a pool's engines are saturated, new requests wait at the gateway
in per-flow queues and leave them by priority band, fairly across flows within a band.

Modules: `params.py` (the `flow_control:` sections, pydantic only), `saturation.py` (each
worker's room, from the engines' scraped load and this replica's requests not yet started),
`queue.py` (the bands and per-flow queues, start-time fair queuing), `admission.py` (`FlowControl`:
flows, holding and releasing requests, the metrics), `priority.py` (the engines' `priority` field
under the gateway's control). This file imports nothing, so that `params.py` loads alone.
"""
