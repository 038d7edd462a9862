"""Developer tools: LLaDA2's checkpoint format (llada2_format), the tiny random checkpoint
builder, and train/ (training of the small default model)."""
