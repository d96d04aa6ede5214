"""The layer kinds: basic.py (what they all share), attention.py, mla.py, deltanet.py, qsa.py, ple.py,
hyper.py and moe.py. Import from the module that defines a name; this package re-exports nothing."""
