import Foundation
import Testing

@testable import GemmaANE

private func family(_ name: String) throws -> (BPETokenizer, [String: Any]) {
    let doc = try TextGoldens.json("tokenizers.json") as! [String: Any]
    let golden = doc[name] as! [String: Any]
    let tokenizer = try BPETokenizer(contentsOf: TextGoldens.directory().appendingPathComponent(golden["file"] as! String))
    return (tokenizer, golden)
}

private let families = ["byte-level", "sentencepiece"]

@Test(arguments: families) func tokenizerEncodesTheHostileCorpusAsTokenizersDoes(_ name: String) throws {
    let (tokenizer, golden) = try family(name)
    #expect(tokenizer.vocabularySize == golden["vocab_size"] as! Int)
    #expect(tokenizer.specialIDs == Set(golden["special"] as! [Int]))
    for case let t as [String: Any] in golden["texts"] as! [Any] {
        let text = t["text"] as! String
        #expect(tokenizer.encode(text) == t["ids"] as! [Int], "\(name): \(text.debugDescription.prefix(60))")
        #expect(tokenizer.encode(text, matchSpecial: false) == t["plain_ids"] as! [Int], "\(name) plain: \(text.prefix(60))")
    }
}

@Test(arguments: families) func tokenizerDecodesAsTokenizersDoes(_ name: String) throws {
    let (tokenizer, golden) = try family(name)
    for case let t as [String: Any] in golden["texts"] as! [Any] {
        let ids = t["ids"] as! [Int]
        #expect(tokenizer.decode(ids, skipSpecialTokens: true) == t["decoded"] as! String)
        #expect(tokenizer.decode(ids, skipSpecialTokens: false) == t["decoded_special"] as! String)
    }
    for case let c as [String: Any] in golden["cuts"] as! [Any] {
        let ids = c["ids"] as! [Int]
        #expect(tokenizer.decode(ids) == c["decoded"] as! String, "\(name) cut \(ids)")
    }
}

@Test(arguments: families) func tokenizerStreamsAsTheRuntimesDetokenizer(_ name: String) throws {
    let (tokenizer, golden) = try family(name)
    for case let s as [String: Any] in golden["streams"] as! [Any] {
        var stream = StreamingDetokenizer(tokenizer: tokenizer)
        let ids = s["ids"] as! [Int]
        let pieces = ids.map { stream.push($0) }
        #expect(pieces == s["pieces"] as! [String], "\(name) \(ids.prefix(12))")
        #expect(stream.flush() == s["flush"] as! String, "\(name) flush \(ids.prefix(12))")
    }
}
