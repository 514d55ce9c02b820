"""streamrl: reinforcement learning of LLM agents from verifiable rewards, as a streaming
pipeline on Redis. See README.md and DESIGN.md."""

__version__ = "0.1.0"
