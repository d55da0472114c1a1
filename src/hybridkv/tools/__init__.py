"""Command line, demo, benchmarks and the workload simulator, over the library."""
