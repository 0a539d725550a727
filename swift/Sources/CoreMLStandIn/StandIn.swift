@_exported import GemmaANE
