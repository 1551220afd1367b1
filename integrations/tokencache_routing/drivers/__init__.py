"""What drives the core's steps: the deterministic event loop with the overlapped pipeline and
the engine clock it keeps (events.py), and the threaded driver (threaded.py, one thread per
model). Drivers see the engine through core/driver_api.py's DriverEngine only."""
