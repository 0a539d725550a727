"""The bundle's error: a bundle that is missing or damaged."""


class BundleError(ValueError):
    """A bundle that is missing or damaged; the message names the file."""
