"""The run: the loop that builds and watches the threads, their factories, producers, workers, torchrun ranks, and
the FP8 target's check at the start."""
