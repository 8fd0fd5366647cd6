"""Runtime: cache per function, guards, recompiles, eager fallback."""
