"""Runtime, the top layer: cache per function, guards, recompiles, eager fallback (compiled.py), and
captures kept across processes (capture_cache.py)."""
