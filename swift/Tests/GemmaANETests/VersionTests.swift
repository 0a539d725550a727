import Testing
@testable import GemmaANE

@Test func versionIsSet() { #expect(!GemmaANEVersion.string.isEmpty) }
