"""Benchmarks and checks run by hand: soak, long prompts, request features, the GPU check,
the host-sync counter."""
