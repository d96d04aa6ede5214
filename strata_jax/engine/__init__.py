"""The layer above model/ and offload/: code that needs both (model/ may not import offload/'s planner)."""
