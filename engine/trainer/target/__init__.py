"""The frozen target: loading it with layer hooks, FP8, the built-in targets, their tokenizer and model configs."""
