"""The backend driver, above codegen: a graph's programs built (ops -> autograd -> lower -> schedule
-> codegen: driver.py), run in training (training.py) and as CUDA graphs (cudagraphs.py), and kept
on disk (program_cache.py)."""
