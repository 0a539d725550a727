"""The bundle's error: a bundle that is missing or damaged (one of the package's errors, `gemma_ane.errors`)."""

from ..errors import BundleError

__all__ = ["BundleError"]
