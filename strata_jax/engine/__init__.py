"""The engine: the frozen runtime config, the Model (weights, tokenizer, expert cache) and the Session that runs its jitted programs."""
