"""The agent core: phase machine, the single transition handler, keys, policies, producer client and CLI."""
