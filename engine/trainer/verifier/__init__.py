"""The frozen target: loading it with layer hooks, FP8 (and its agreement with the exact target), the built-in
targets, their tokenizer and model configs."""
