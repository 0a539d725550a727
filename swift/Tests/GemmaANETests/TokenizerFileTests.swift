import Foundation
import Testing

@testable import GemmaANE

/// A minimal valid tokenizer.json, with one field replaced.
private func file(_ change: (inout [String: Any]) -> Void) throws -> Data {
    var doc: [String: Any] = [
        "added_tokens": [["id": 3, "content": "<eos>", "special": true]],
        "normalizer": NSNull(), "pre_tokenizer": NSNull(), "decoder": NSNull(),
        "model": ["type": "BPE", "vocab": ["a": 0, "b": 1, "ab": 2], "merges": ["a b"]] as [String: Any],
    ]
    change(&doc)
    return try JSONSerialization.data(withJSONObject: doc)
}

private func refused(_ data: Data, _ message: String) {
    #expect(throws: GemmaANEError(.bundle, message)) { try BPETokenizer(json: data, file: "b/tokenizer.json") }
}

@Test func tokenizerFileMinimalLoads() throws {
    let t = try BPETokenizer(json: try file { _ in })
    #expect(t.encode("abab<eos>") == [2, 2, 3])
    #expect(t.vocabularySize == 4 && t.specialIDs == [3])
}

@Test func tokenizerFileRefusesWhatItCannotRunNamingFileAndField() throws {
    refused(Data("{\"model\": ".utf8), "b/tokenizer.json: not valid JSON (unexpected end at byte 10)")
    refused(Data("[1, 2]".utf8), "b/tokenizer.json: expected a JSON object")
    refused(Data([0x7B, 0x22, 0xFF, 0x22, 0x3A, 0x31, 0x7D]), "b/tokenizer.json: not valid JSON (not UTF-8 text)")
    refused(Data((String(repeating: "[", count: 600) + String(repeating: "]", count: 600)).utf8),
        "b/tokenizer.json: not valid JSON (nested more than 512 deep at byte 512)")
    refused(try file { $0["model"] = nil }, "b/tokenizer.json: model: expected an object")
    refused(try file { $0["model"] = ["type": "Unigram", "vocab": []] }, "b/tokenizer.json: model.type: 'Unigram' is not supported (BPE only)")
    refused(
        try file { $0["model"] = ["type": "BPE", "vocab": ["a": "x"], "merges": []] },
        "b/tokenizer.json: model.vocab: 'a': x is not a token id")
    refused(
        try file { $0["model"] = ["type": "BPE", "vocab": ["a": 0], "merges": ["a c"]] },
        "b/tokenizer.json: model.merges[0]: a c does not join two pieces of the vocabulary into one")
    refused(
        try file { $0["model"] = ["type": "BPE", "vocab": ["a": 0], "merges": [], "continuing_subword_prefix": "##"] },
        "b/tokenizer.json: model.continuing_subword_prefix: is not supported")
    refused(
        try file { $0["normalizer"] = ["type": "NFKC"] },
        "b/tokenizer.json: normalizer.type: 'NFKC' is not supported (Replace, Prepend)")
    refused(
        try file { $0["pre_tokenizer"] = ["type": "Sequence", "pretokenizers": [["type": "Split", "pattern": ["Regex": "\\s+"], "behavior": "Isolated"]]] },
        "b/tokenizer.json: pre_tokenizer.pretokenizers[0].pattern: only a non-empty String pattern is supported (no Regex)")
    refused(try file { $0["decoder"] = ["type": "WordPiece"] }, "b/tokenizer.json: decoder.type: 'WordPiece' is not supported (ByteLevel, Replace, ByteFallback, Fuse, Strip)")
    refused(
        try file { $0["added_tokens"] = [["id": 3, "content": "<eos>", "lstrip": true]] },
        "b/tokenizer.json: added_tokens[0].lstrip: is not supported")
    refused(try file { $0["added_tokens"] = [["id": -3, "content": "x"]] }, "b/tokenizer.json: added_tokens[0]: expected an id and a non-empty content")
}

@Test func tokenizerFileMissingIsOneLine() {
    let path = "/nonexistent/tokenizer.json"
    #expect(throws: GemmaANEError.self) { try BPETokenizer(contentsOf: URL(fileURLWithPath: path)) }
    do {
        _ = try BPETokenizer(contentsOf: URL(fileURLWithPath: path))
    } catch let error as GemmaANEError {
        #expect(error.kind == .bundle && error.message.hasPrefix(path + ": unreadable tokenizer") && !error.message.contains("\n"))
    } catch {
        Issue.record("not a GemmaANEError: \(error)")
    }
}

@Test func tokenizerFileKeepsCanonicallyEquivalentPiecesApart() throws {
    // Swift's String == takes these for one (a Swift dictionary literal of them traps); the tokenizer does not
    let json = #"{"model": {"type": "BPE", "vocab": {"\u00C5": 0, "\u212B": 1, "e\u0301": 2, "\u00E9": 3, "e": 4, "\u0301": 5}, "merges": ["e \u0301"]}}"#
    let t = try BPETokenizer(json: Data(json.utf8))
    #expect(t.encode("\u{00C5}\u{212B}") == [0, 1])
    #expect(t.encode("e\u{0301}\u{00E9}") == [2, 3])
    #expect(t.id(of: "\u{212B}") == 1 && t.id(of: "\u{00E9}") == 3)
}
