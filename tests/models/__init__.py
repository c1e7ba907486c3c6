"""The worker's model side on the CPU: models, loaders, tokenizers, the sampler, against references."""
