"""Model files, torch-free: what Sluice reads from (and writes to) a checkpoint directory.

    tokenizer.py      Tokenizer: tokenizer.json, tokenizer_config.json, generation_config.json
    token_bound.py    the longest token in bytes, where a length bound is provably sound
    chat_template.py  where the chat template lives, HF's sandboxed jinja, message validation
    model_config.py   ModelConfig: config.json parsed once
    revision.py       the weight files and the revision hash over them
    tiny_model.py     the deterministic default checkpoint (write_tiny_model, ensure_tiny_model)
    errors.py         ModelFileError and its tree

The gateway (exact prompt token counts), the engine, `sluice plan`, the bench and the load tool
import it. It imports no other part of Sluice, and never torch: the weights it writes are
numpy arrays, saved with ``safetensors.numpy``.
"""
