"""loom: training multimodal LLMs across many devices.

See docs/ for the concepts and docs/architecture.md for the architecture.
"""

__version__ = "0.1.0"
