"""redraft: speculative decoding toolkit."""
__version__ = "0.1.0"
