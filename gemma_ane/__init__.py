"""gemma-ane: Gemma 4 E2B-it for the Apple Neural Engine."""

__version__ = "0.1.0"
