"""For every test: the program cache (backend/program_cache.py) off, so that each test's graphs
go through the backend it tests (a test that breaks a backend stage, or counts its calls, would
otherwise load another test's or an earlier run's programs). tests/backend/test_program_cache.py
turns it on in the processes it starts."""
import os

os.environ.setdefault("FUSELENS_PROGRAM_CACHE", "0")
