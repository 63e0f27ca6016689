"""The base and its adapters: loading a base (by name, file or GGUF), the policy / reference / base adapters,
switching between them, syncing the reference slot, and adapters on disk."""
