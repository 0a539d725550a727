import Testing
@testable import GemmaANE

@Test func errorDescribesItselfInOneLine() {
    let error = GemmaANEError(.bundle, "model_config.json: vocab_size: -1 is not a positive integer")
    #expect("\(error)" == error.message)
    #expect(error.kind == .bundle)
}
