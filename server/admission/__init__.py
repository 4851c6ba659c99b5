"""Whether another call fits: the CPU this process may use (one count for every engine), its
measured load, and per-address rate limits."""
