"""Training of the small block-diffusion model that ships as dllm-serve's default model.

    problems.py   generated arithmetic word problems with exact answers (deterministic by seed)
    data.py       GSM8K + generated problems in the GSM8K prompt format, tokenized into pools
    tokenizer.py  byte-level BPE trained on the training text, LLaDA2's special tokens
    batches.py    length-bucketed, resumable batches
    objective.py  block-diffusion layout, mask, noise (M2T masks + T2T corruption) and loss
    attention.py  the training attention backend (no KV cache, one dense mask, SDPA)
    balance.py    aux-loss-free expert balancing through the routers' expert_bias
    checkpoint.py the standard HF checkpoint (LLaDA2's names) and the resumable train state
    config.py, setup.py, progress.py, trainer.py   settings, preparation, bookkeeping, loop
    evaluate.py   held-out exact match, forwards per block and T2T edits through the Engine
Entry points: scripts/train_small_dllm.py and scripts/eval_small_dllm.py.
"""
