"""The tiny engine config the torchrun tests start (two replica threads per rank, CPU, a few MB of model)."""

TINY_ENGINE_TOML = """
target = "tiny"
target_devices = ["cpu"]
drafter_devices = ["cpu", "cpu"]
drafter_mode = "replicas"
buckets = [64]
batch_size = 2
ttt_steps = 2
draft_vocab_size = 64
torch_threads = 1
tiny_hidden = 32
tiny_layers = 4
eval_holdout = 0
heartbeat_interval_s = 0.5
"""
