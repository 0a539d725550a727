import Foundation

/// Where everything lives in a bundle directory (CONTRACT §2), as `gemma_ane/bundle/layout.py` spells it.
public enum BundleLayout {
    public static let manifest = "manifest.json"
    public static let modelConfig = "model_config.json"
    public static let generationConfig = "hf_model/generation_config.json"
    public static let tokenizer = "hf_model/tokenizer.json"
    public static let embedQ8 = "embed_tokens_q8.bin"
    public static let embedScales = "embed_tokens_scales.bin"
    public static let pleQ8 = "embed_tokens_per_layer_q8.bin"
    public static let pleScales = "embed_tokens_per_layer_scales.bin"
    /// layer type -> its RoPE tables' suffix (cos_sliding.npy, sin_full.npy, ...)
    public static let ropeShort = [("sliding_attention", "sliding"), ("full_attention", "full")]
    public static let maxChunks = 9

    public static func chunkName(_ index: Int) -> String { "chunk_\(index + 1)" }

    /// chunk_1 ... chunk_N as `.mlpackage` (or compiled `.mlmodelc`), in order, up to the first missing one.
    public static func chunkPaths(_ root: URL) throws -> [URL] {
        var found: [URL] = []
        for i in 0..<maxChunks {
            let candidates = ["mlpackage", "mlmodelc"].map { root.appendingPathComponent("\(chunkName(i)).\($0)") }
            guard let path = candidates.first(where: { FileManager.default.fileExists(atPath: $0.path) }) else { break }
            found.append(path)
        }
        guard !found.isEmpty else {
            throw GemmaANEError(.bundle, "\(root.path): no chunk_1.mlpackage or chunk_1.mlmodelc")
        }
        return found
    }
}
