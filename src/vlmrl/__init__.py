"""vlmrl: GSPO reinforcement learning for Qwen3-VL on visual maths, from data to GGUF."""

__version__ = "0.1.0"
