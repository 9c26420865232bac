"""Training data: tokenized conversations and their cache, the held-out split, batch dispatch, the draft vocabulary."""
