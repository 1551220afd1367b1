"""The commands: the serving benchmark (bench, bench_workloads, bench_plots), the demo, the
router's labels, training and quality sweep (labels, train_router, quality). Each runs as
python -m tokencache_routing COMMAND (__main__.py). Importing this package imports none of
them (the commands start without torch)."""
