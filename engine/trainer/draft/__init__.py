"""The EAGLE-3 drafter: model, attention paths and the training-time-test masks."""
