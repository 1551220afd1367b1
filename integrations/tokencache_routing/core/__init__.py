"""The engine's core: request state and the typed driver interfaces (state), KV handles over
tokencache cursors (kv), the routers and their features (routers, features), sampling and the
counter-based RNG (sampling, rng), batch building (batch, prefix) and the step rules
(scheduler). Nothing here imports drivers/, sim/, baselines/ or tools/ (the import-graph test
checks it)."""
