"""The converter (needs torch and coremltools): `driver` runs the components a checkpoint has (`text`, `assistant`,
`vision`), each converted with the Core ML toolkit (`coreml`, `palettize`) from the PyTorch model math in
`models/`; the bundle it writes is `gemma_ane.bundle`'s format."""

from .coreml import convert_function
from .driver import convert, model_card, open_source, resolve_source
from .options import ConvertError, ConvertOptions, StageTimer

__all__ = [
    "ConvertError",
    "ConvertOptions",
    "StageTimer",
    "convert",
    "convert_function",
    "model_card",
    "open_source",
    "resolve_source",
]
