"""What the engine's threads share: stop requests and failures, heartbeats, the compile guard, the queue, output."""
