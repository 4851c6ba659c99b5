"""Vocable benchmarks: voice-to-voice latency over the real media path, component timings."""
