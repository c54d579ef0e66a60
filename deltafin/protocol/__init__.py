"""Typed OpenAI requests and the engine-facing parameters they map to."""
