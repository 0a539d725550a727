import GemmaANE
