"""Deltafin: an OpenAI-compatible LLM serving appliance driven by Hydra configs."""

__version__ = "0.1.0"
