"""What several test files share: tiny models and cards, fixtures' loaders, the parity harness.

Imported as ``helpers`` (tests/conftest.py puts tests/ on the path).
"""
