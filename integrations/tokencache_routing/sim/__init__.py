"""The modelled GPU clock: per-forward costs from a measured profile or a roofline (clock.py)
and the large model at tensor-parallel degree N (tp_cost.py)."""
