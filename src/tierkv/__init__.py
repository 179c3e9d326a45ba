"""tierkv: a tiered KV-cache service for LLM inference engines."""

__version__ = "0.1.0"
