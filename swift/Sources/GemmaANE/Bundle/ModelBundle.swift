import Foundation

/// A converted bundle as the host reads it (CONTRACT §2): model_config.json checked field by field, the
/// generation config, the manifest when there is one, the chunks' paths, the host tables mapped by row.
/// What runs the chunks (`ChunkRunner`s) is opened separately over `chunkPaths`.
public final class ModelBundle: @unchecked Sendable {
    public let root: URL
    public let config: ModelConfig
    public let generation: GenerationConfig
    /// manifest.json (ours; the published layout has none).
    public let manifest: [String: BundleJSON]?
    public let chunkPaths: [URL]
    public let host: HostTables

    public init(_ root: URL) throws {
        var isDirectory: ObjCBool = false
        guard FileManager.default.fileExists(atPath: root.path, isDirectory: &isDirectory), isDirectory.boolValue else {
            throw GemmaANEError(.bundle, "\(root.path): not a bundle directory")
        }
        self.root = root
        let configURL = root.appendingPathComponent(BundleLayout.modelConfig)
        config = try ModelConfig(json: try readJSONObject(configURL), file: configURL.path)
        let manifestURL = root.appendingPathComponent(BundleLayout.manifest)
        manifest = FileManager.default.fileExists(atPath: manifestURL.path) ? try readJSONObject(manifestURL) : nil
        generation = try GenerationConfig(root: root)
        // model_config.json states the chunks of any other layout than the published three
        let expected = config.chunkCount ?? 3
        chunkPaths = try BundleLayout.chunkPaths(root)
        guard chunkPaths.count == expected else {
            throw GemmaANEError(
                .bundle,
                "\(root.path): expected chunk_1..\(BundleLayout.chunkName(expected - 1)) (\(BundleLayout.modelConfig)), found \(chunkPaths.count) chunks"
            )
        }
        host = try HostTables(root: root, config: config)
    }

    /// The ids that end a generation (CONTRACT §1): <eos>, <|tool_response>, <turn|>, generation_config.json's
    /// eos_token_id and model_config.json's.
    public var stopIds: Set<Int> {
        Set([1, 50, 106] + generation.eosTokenIds + [config.eosTokenId ?? 1])
    }
}
