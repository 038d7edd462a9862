"""Developer tools: builders of small checkpoints in the exact HF layout of the real models."""
