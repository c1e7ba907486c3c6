"""The clients' tests run against the fake scheduler: its ``env`` and ``tokenizer`` fixtures."""

from tests.support.fake_env import env, tokenizer  # noqa: F401
