"""The run: the loop that builds and watches the threads, their factories, producers, workers, and torchrun ranks."""
