"""The clients (sync, asyncio, LLM) against a fake scheduler on real sockets."""
