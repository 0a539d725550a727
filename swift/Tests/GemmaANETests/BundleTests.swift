import Foundation
import Testing
@testable import GemmaANE

/// A copy of the goldens' host tables as a bundle of three (empty) chunk packages, damaged by `damage`.
func damagedBundle(_ damage: (URL) throws -> Void) throws -> URL {
    let url = FileManager.default.temporaryDirectory.appendingPathComponent("gemma-ane-damaged-\(UUID().uuidString)")
    try FileManager.default.copyItem(at: try EngineGoldens.dir().appendingPathComponent("host"), to: url)
    for i in 1...3 {
        try FileManager.default.createDirectory(at: url.appendingPathComponent("chunk_\(i).mlpackage"), withIntermediateDirectories: true)
    }
    try damage(url)
    return url
}

@Test func bundleReadsWhole() throws {
    let bundle = try ModelBundle(try damagedBundle { _ in })
    #expect(bundle.chunkPaths.map(\.lastPathComponent) == ["chunk_1.mlpackage", "chunk_2.mlpackage", "chunk_3.mlpackage"])
    #expect(bundle.stopIds == [1, 50, 106])
    #expect(bundle.host.rope.keys.sorted() == ["full_attention", "sliding_attention"])
}

@Test func bundleDamageIsOneErrorNamingTheFile() throws {
    let cases: [(String, (URL) throws -> Void)] = [
        ("model_config.json: missing", { try FileManager.default.removeItem(at: $0.appendingPathComponent("model_config.json")) }),
        ("model_config.json: not valid JSON", { try Data("{\"vocab_size\": ".utf8).write(to: $0.appendingPathComponent("model_config.json")) }),
        ("model_config.json: expected a JSON object", { try Data("[1]".utf8).write(to: $0.appendingPathComponent("model_config.json")) }),
        ("embed_tokens_q8.bin: 100 bytes, expected", { try Data(count: 100).write(to: $0.appendingPathComponent("embed_tokens_q8.bin")) }),
        ("embed_tokens_per_layer_scales.bin: missing", { try FileManager.default.removeItem(at: $0.appendingPathComponent("embed_tokens_per_layer_scales.bin")) }),
        ("cos_sliding.npy: not a valid .npy file (no magic)", { try Data(count: 200).write(to: $0.appendingPathComponent("cos_sliding.npy")) }),
        ("sin_full.npy: missing", { try FileManager.default.removeItem(at: $0.appendingPathComponent("sin_full.npy")) }),
        ("expected chunk_1..chunk_3 (model_config.json), found 2 chunks", { try FileManager.default.removeItem(at: $0.appendingPathComponent("chunk_3.mlpackage")) }),
        ("generation_config.json: eos_token_id='1': expected a token id or a list of token ids", {
            try Data("{\"eos_token_id\": \"1\"}".utf8).write(to: $0.appendingPathComponent("hf_model/generation_config.json"))
        }),
    ]
    for (needle, damage) in cases {
        let url = try damagedBundle(damage)
        do {
            _ = try ModelBundle(url)
            Issue.record("no error for \(needle)")
        } catch let e as GemmaANEError {
            #expect(e.kind == .bundle && e.message.contains(needle) && !e.message.contains("\n"), "\(e.message)")
        }
    }
}
