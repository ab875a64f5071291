"""The test suite's helpers (tests/ is on sys.path while pytest runs: `from helpers.launch import asyncrl`);
fixtures stay in tests/conftest.py."""
