"""The engine: its one frozen configuration (config.py), validated before any weight is read."""
