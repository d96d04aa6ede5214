"""The engine: the layer above model/ and offload/: the frozen runtime config, the Model (weights,
tokenizer, expert cache), the jitted prefill and decode programs (programs.py) with their on-device
sampling (sampling.py), the Session that runs them, and reports that need both."""
