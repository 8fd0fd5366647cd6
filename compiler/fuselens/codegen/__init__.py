"""Triton kernels (triton.py), their loading and launching (launcher.py), the Python wrapper (wrapper.py)."""
