"""One dialect per client API (issue 21 §2): what the gateway knows of each proxied API, in one class
per API behind one interface (`base.Dialect`): parsing and size bounds, routing features, the engine
path and body rules (the output limit's name, the usage patch), stream-terminal and error events,
and errors rendered in the API's own shape.

`names` holds the API names (`Api`) and imports nothing, so any module may use them (`config`
too); `registry.dialect_for(api)` gives an API's dialect. No other gateway module spells an API's
name (`tests/unit/test_dialect_guard.py`).
"""
