"""Development helpers kept out of the runtime modules: synthetic GGUF files and the default model's assembly."""
