import GemmaANE
print(GemmaANEVersion.string)
