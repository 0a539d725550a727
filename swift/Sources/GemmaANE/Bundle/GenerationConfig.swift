import Foundation

/// hf_model/generation_config.json, or nothing when the bundle has none: the sampling defaults (read by
/// `SamplingOptions(generationConfig:)` from `fields`) and the end-of-sequence ids, checked as
/// `runtime.model._generation_config` checks them.
public struct GenerationConfig: @unchecked Sendable {
    /// The file's fields in Foundation's form; empty without a file.
    public let fields: [String: Any]
    public let eosTokenIds: [Int]

    public init(root: URL) throws {
        let url = root.appendingPathComponent(BundleLayout.generationConfig)
        guard FileManager.default.fileExists(atPath: url.path) else {
            fields = [:]
            eosTokenIds = []
            return
        }
        let object = try readJSONObject(url)
        let eos = object["eos_token_id"] ?? .array([])
        let ids = eos.array ?? [eos]
        guard ids.allSatisfy({ ($0.int ?? -1) >= 0 }) else {
            throw GemmaANEError(.bundle, "\(url.path): eos_token_id=\(eos.short): expected a token id or a list of token ids")
        }
        fields = object.mapValues(\.any)
        eosTokenIds = ids.compactMap(\.int)
    }
}
