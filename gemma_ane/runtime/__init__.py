"""The runtime side: loads a bundle and generates (numpy only; never torch, transformers or the converter)."""
