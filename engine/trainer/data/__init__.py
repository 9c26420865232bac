"""Training data: tokenized conversations and their cache, the held-out split, sequence packing, batch dispatch,
the draft vocabulary."""
