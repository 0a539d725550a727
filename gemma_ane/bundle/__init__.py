"""The bundle format (CONTRACT §2): one owner for what a converted bundle holds. The converter writes it and the
runtime reads it through these modules alone:

- `layout`: every file and sidecar name, and the one function that lists a bundle's files;
- `schema`: model_config.json, built and checked by the same rules on write and on read;
- `interfaces`: every model's interfaces, from the package or as the bundle states them;
- `tables`: the host's tables (int8 rows, scales, RoPE rows, .npy sidecars);
- `check`: the manifest check, `gemma-ane inspect` and `check`, the published layout told apart;
- `opened`: `open(root) -> Bundle`, a bundle checked and its config parsed once, what every runtime opener takes.

Opening a bundle to run it (`backend.open_engine`) stands on these; nothing here runs a model.
"""

from .check import check_bundle, check_manifest, converted_elsewhere, inspect_bundle, is_published, prompt_paths
from .errors import BundleError
from .layout import ONE_FUNCTION_MODELS, bundle_files, chunk_paths
from .opened import Bundle, BundleConfig, open_bundle
from .schema import read_model_config
from .tables import HostTables, RowTable, load_host, load_npy

open = open_bundle  # bundle.open(root): the builtin is never needed in this package's namespace

__all__ = [
    "ONE_FUNCTION_MODELS",
    "Bundle",
    "BundleConfig",
    "BundleError",
    "HostTables",
    "RowTable",
    "bundle_files",
    "check_bundle",
    "check_manifest",
    "chunk_paths",
    "inspect_bundle",
    "is_published",
    "converted_elsewhere",
    "load_host",
    "load_npy",
    "open",
    "open_bundle",
    "prompt_paths",
    "read_model_config",
]
