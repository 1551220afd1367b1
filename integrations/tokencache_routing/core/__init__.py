"""The engine's core: request state and what a handle asks of its engine (state), the engine
and driver interfaces (driver_api), KV handles over tokencache cursors (kv), the routers and
their features (routers, features), sampling and the counter-based RNG (sampling, rng), batch
building (batch, prefix) and the scheduler (scheduler, composed of request_lists, admission,
batch_planning and forward_finishing; its settings in scheduler_config, the catch-up launch
rules and their prices in launch_policy). Nothing here imports drivers/, sim/, baselines/ or
tools/ (the import-graph test checks it)."""
