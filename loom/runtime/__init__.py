"""The runtime: stages, process groups, point-to-point communication and the IR executor."""
