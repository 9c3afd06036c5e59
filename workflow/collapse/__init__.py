"""collapse: train LLM families whose normalized loss curves collapse (arXiv 2509.25087)."""

__version__ = "0.1.0"
