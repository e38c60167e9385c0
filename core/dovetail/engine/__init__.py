"""The engine: requests, KV-cache manager, scheduler, model runner, sampler, output processing."""
