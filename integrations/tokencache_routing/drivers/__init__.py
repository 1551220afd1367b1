"""What drives the core's steps: the threaded driver (threaded.py, one thread per model).
The event-loop driver and the overlapped pipeline are RoutedEngine's own (engine.py)."""
