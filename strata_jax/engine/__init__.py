"""The engine: the layer above model/ and offload/: the frozen runtime config, the Model (weights,
tokenizer, expert cache), the Session that runs its jitted programs, and reports that need both."""
