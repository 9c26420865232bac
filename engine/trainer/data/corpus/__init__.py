"""The demo corpus shipped with the trainer (corpus.jsonl, made by engine.trainer.data.corpus_gen)."""
