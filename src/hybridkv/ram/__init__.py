"""The RAM tier: eviction policies, slot pools, grouped pools, shared memory regions."""
