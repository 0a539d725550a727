"""The oracle side: transformers, and what measures a bundle against it (verify, eval) or builds tiny checkpoints."""
