"""Pure state machines and pure modules, one at a time: no processes, sockets or model."""
