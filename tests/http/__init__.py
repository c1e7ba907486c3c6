"""The OpenAI-compatible server: real vllm-actors serve processes or the app over a fake scheduler."""
