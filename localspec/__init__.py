"""localspec: local LLM inference made faster with speculative decoding."""

__version__ = "0.1.0"
