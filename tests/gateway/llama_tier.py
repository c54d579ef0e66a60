"""The llama-server tier's session fixtures (registered by tests/conftest.py's pytest_plugins)."""
