import GemmaANE
print("gemma-ane-swift")
