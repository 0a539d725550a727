"""A bundle opened once (`bundle.open(root) -> Bundle`): checked as `load` checks it (check.checked_bundle), its
model_config.json parsed once into typed records, its paths found once. Every opener of the runtime takes the Bundle
(with a runtime.device.Device) rather than a directory to read again."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import layout
from .check import checked_bundle
from .errors import BundleError
from .schema import ASSISTANT, AUDIO, VISION, AssistantConfig, AudioConfig, TextConfig, VisionConfig, read_model_config


@dataclass(frozen=True)
class BundleConfig:
    """model_config.json as its records: the text model's, and each one-function model's when the bundle has it.
    `raw`: the file as read (checked), for the readers that index the published layout's fields by name."""

    text: TextConfig
    assistant: AssistantConfig | None
    vision: VisionConfig | None
    audio: AudioConfig | None
    raw: dict

    @classmethod
    def of(cls, config: dict, where: str) -> BundleConfig:
        """A config check_model_config has passed, as records (from_json runs the rules again: no file read)."""
        entries = {
            key: record.from_json(config, where) if key in config else None
            for key, record in ((ASSISTANT, AssistantConfig), (VISION, VisionConfig), (AUDIO, AudioConfig))
        }
        return cls(TextConfig.from_json(config, where), raw=config, **entries)


@dataclass(frozen=True)
class Bundle:
    """An opened bundle: its directory, its config, its chunks (chunk_1 .. chunk_N, packages or compiled), and the
    files the runtime reads beside them."""

    root: Path
    config: BundleConfig
    chunks: list[Path]

    @property
    def tokenizer(self) -> Path:
        return self.root / layout.HF_TOKENIZER

    @property
    def generation_config(self) -> Path:
        return self.root / layout.HF_GENERATION_CONFIG

    @property
    def hf_dir(self) -> Path:
        return self.root / layout.HF_DIR

    @property
    def manifest(self) -> Path | None:
        path = self.root / layout.MANIFEST
        return path if path.is_file() else None


def open_bundle(root, verify: bool = False, check: bool = True) -> Bundle:
    """The bundle at `root`, checked as `load` checks it (verify=True: every file's sha256 against the manifest too):
    a BundleError with the first problem (and how many more `gemma-ane check` lists). check=False reads only what
    the Bundle holds (model_config.json's rules still apply), for tools that report a damaged file when they reach
    it (`verify`, `eval`)."""
    root = Path(root)
    if check:
        problems, config = checked_bundle(root, sha256=verify)
        if problems:
            more = len(problems) - 1
            plural = "s" if more > 1 else ""
            raise BundleError(
                problems[0] + (f" (and {more} more problem{plural}; see gemma-ane check)" if more else "")
            )
    else:
        config = read_model_config(root)
    return Bundle(root, BundleConfig.of(config, str(root / layout.MODEL_CONFIG)), layout.chunk_paths(root))
