"""Developer tools: the checkpoint formats of LLaDA2 (llada2_format) and SDAR (sdar_format), the
tiny tokenizers and random checkpoint builder, and train/ (training of the small default
model)."""
