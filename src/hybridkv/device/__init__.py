"""torch on any device: copies between an engine's paged tensors and the shared RAM regions,
and the CUDA host registration those copies need. Nothing here knows a serving engine."""
