"""What the tests share: fakes, tiny checkpoints, helpers for servers, event streams and traces."""
