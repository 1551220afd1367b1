"""The commands: the serving benchmark (bench, bench_workloads, bench_plots), the demo, the
router's labels, training and quality sweep (labels, train_router, quality). Each keeps its
documented command line through a thin module at the old path (python -m
tokencache_routing.bench and so on). Importing this package imports none of them (the
commands start without torch)."""
