"""Model files from a Hugging Face-compatible hub: the listing (sizes and sha256 the hub publishes),
verified resumable downloads, and `REPO:FILE` model references resolved through the pull cache.
Imports core only."""

from strata_jax.hub.api import HubError, RemoteFile, RepoListing
from strata_jax.hub.pull import PulledFile, pull, resolve_model

__all__ = ["HubError", "PulledFile", "RemoteFile", "RepoListing", "pull", "resolve_model"]
