import Foundation
import Testing

@testable import GemmaANE

/// A JSON value with every object's members sorted by key, so a parse and the Python dict compare.
private func canonical(_ v: JSONValue) -> JSONValue {
    switch v {
    case .object(let m): return .object(m.map { .init($0.key, canonical($0.value)) }.sorted { $0.key < $1.key })
    case .array(let a): return .array(a.map(canonical))
    default: return v
    }
}

private func same(_ delta: OutputDelta, _ expected: [String: Any]) throws -> Bool {
    let calls = try (expected["tool_calls"] as! [[String: Any]]).map {
        ($0["name"] as! String, canonical(try JSONValue(foundation: $0["arguments"]!)))
    }
    return delta.content == expected["content"] as! String && delta.reasoning == expected["reasoning"] as! String
        && delta.toolCalls.count == calls.count
        && zip(delta.toolCalls, calls).allSatisfy { $0.name == $1.0 && canonical($0.arguments) == $1.1 }
}

@Test func outputParserSplitsAsTheRuntimesParser() throws {
    let tokenizer = try BPETokenizer(contentsOf: TextGoldens.directory().appendingPathComponent("tokenizer-byte-level.json"))
    let cases = try TextGoldens.json("output.json") as! [[String: Any]]
    #expect(cases.count >= 12)
    for (n, c) in cases.enumerated() {
        var parser = try OutputParser(
            tokenizer: tokenizer, stop: c["stop"] as! [String], toolNames: (c["tools"] as? [String]).map(Set.init))
        let ids = c["ids"] as! [Int]
        for (i, expected) in (c["deltas"] as! [[String: Any]]).enumerated() {
            let delta = parser.push(ids[i])
            let ok = try same(delta, expected)
            #expect(ok, "case \(n) token \(i): \(delta) != \(expected)")
        }
        let finish = parser.finish()
        let ok = try same(finish, c["finish"] as! [String: Any])
        #expect(ok, "case \(n) finish: \(finish)")
    }
}

@Test func outputParserRefusesTooManyOrTooLongStops() {
    let tokenizer = try! BPETokenizer(json: Data(#"{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}"#.utf8))
    #expect(throws: GemmaANEError(.input, "stop: 5 strings, more than the 4 allowed")) {
        try OutputParser(tokenizer: tokenizer, stop: ["a", "b", "c", "d", "e"])
    }
    #expect(throws: GemmaANEError(.input, "stop[1]: 1001 characters, more than the limit of 1000")) {
        try OutputParser(tokenizer: tokenizer, stop: ["a", String(repeating: "x", count: 1001)])
    }
}

@Test func outputParserBoundsNesting() throws {
    let deep = "call:f{a:" + String(repeating: "[", count: 10_000) + String(repeating: "]", count: 10_000) + "}"
    #expect(throws: (any Error).self) { try GemmaCall.parse(deep) }
    let name = try GemmaCall.parse("call:f{a:[[1]]}").name
    #expect(name == "f")
}
