"""Several engines behind one address: one server process per GPU, a load-aware router in front.

`app.replicas.pool` keeps each replica's load from its own `/health` and `/ready`;
`app.replicas.router` proxies WebSocket sessions and REST requests to the least-loaded ready replica;
`app.replicas.launcher` starts one server per visible GPU plus the router on one host.
"""
