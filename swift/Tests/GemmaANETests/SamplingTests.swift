import Foundation
import Testing

@testable import GemmaANE

private func seed(_ text: Any?) -> UInt64 { UInt64(text as! String)! }

@Test func samplingPCG64IsNumpysStream() throws {
    let doc = try TextGoldens.json("sampling.json") as! [String: Any]
    let cases = doc["pcg"] as! [[String: Any]]
    #expect(cases.count >= 8)
    for c in cases {
        var raw = PCG64(seed: seed(c["seed"]))
        let expectedRaw = (c["raw"] as! [String]).map { UInt64($0)! }
        #expect(expectedRaw.map { _ in raw.nextUInt64() } == expectedRaw, "seed \(c["seed"]!)")
        var doubles = PCG64(seed: seed(c["seed"]))
        let expected = (c["doubles"] as! [String]).map { Double(bitPattern: UInt64($0)!) }
        #expect(expected.map { _ in doubles.nextDouble() } == expected, "seed \(c["seed"]!)")
    }
}

@Test func samplingDrawsThePythonSamplersTokens() throws {
    let doc = try TextGoldens.json("sampling.json") as! [String: Any]
    let cases = doc["cases"] as! [[String: Any]]
    #expect(cases.count >= 40)
    for c in cases {
        let params = c["params"] as! [String: Any]
        let bias = (c["logit_bias"] as! [String: Any]).reduce(into: [Int: Double]()) {
            $0[Int($1.key)!] = ($1.value as! NSNumber).doubleValue
        }
        func number(_ name: String, _ fallback: Double) -> Double {
            (params[name] as? NSNumber)?.doubleValue ?? fallback
        }
        let options = SamplingOptions(
            temperature: number("temperature", 1), topK: (params["top_k"] as? Int) ?? 0, topP: number("top_p", 1),
            minP: number("min_p", 0), repetitionPenalty: number("repetition_penalty", 1),
            presencePenalty: number("presence_penalty", 0), frequencyPenalty: number("frequency_penalty", 0),
            seed: seed(c["seed"]), logitBias: bias)
        var sampler = try Sampler(options: options, history: c["history"] as! [Int], bans: c["bans"] as! [Int])
        let vocab = c["vocab"] as! Int
        let bytes = try TextGoldens.data(c["logits"] as! String)
        let rows = bytes.withUnsafeBytes { Array($0.bindMemory(to: Float.self)) }
        var tokens = [Int]()
        for step in 0..<(c["steps"] as! Int) {
            let token = try rows[(step * vocab)..<((step + 1) * vocab)].withUnsafeBufferPointer { try sampler.sample($0) }
            sampler.observe(token)
            tokens.append(token)
        }
        #expect(tokens == c["tokens"] as! [Int], "\(c["name"]!) seed \(c["seed"]!)")
    }
}

@Test func samplingOptionsRefuseAsThePythonFieldsDo() throws {
    let doc = try TextGoldens.json("sampling.json") as! [String: Any]
    let errors = doc["errors"] as! [[String: Any]]
    #expect(errors.count >= 14)
    for e in errors {
        var options = SamplingOptions()
        for (name, text) in e["params"] as! [String: String] {
            let value = Double(text)!  // Python's repr: nan, inf and numbers all read back
            switch name {
            case "temperature": options.temperature = value
            case "top_k": options.topK = Int(value)
            case "top_p": options.topP = value
            case "min_p": options.minP = value
            case "repetition_penalty": options.repetitionPenalty = value
            case "presence_penalty": options.presencePenalty = value
            case "frequency_penalty": options.frequencyPenalty = value
            default: Issue.record("unknown field \(name)")
            }
        }
        for (key, value) in e["logit_bias"] as! [String: Any] { options.logitBias[Int(key)!] = (value as! NSNumber).doubleValue }
        #expect(throws: GemmaANEError(.input, e["message"] as! String)) {
            try options.validate(vocabularySize: e["vocab"] as? Int)
        }
        if (try? options.validate()) == nil {  // a sampler checks its options too (the vocabulary it learns later)
            #expect(throws: GemmaANEError.self) { try Sampler(options: options) }
        }
    }
}

@Test func samplingDefaultsFromGenerationConfigBlameTheFile() throws {
    let config = try JSONSerialization.jsonObject(
        with: Data(#"{"do_sample": false, "top_k": 64, "top_p": 0.95}"#.utf8)) as! [String: Any]
    let options = try SamplingOptions(generationConfig: config)
    #expect(options.temperature == 0 && options.topK == 64 && options.topP == 0.95)
    // as the Python side: do_sample false, then the file's own temperature over it
    let both = try JSONSerialization.jsonObject(with: Data(#"{"do_sample": false, "temperature": 0.7}"#.utf8))
    #expect(try SamplingOptions(generationConfig: both as! [String: Any]).temperature == 0.7)
    let zero = try JSONSerialization.jsonObject(with: Data(#"{"do_sample": 0}"#.utf8)) as! [String: Any]
    #expect(try SamplingOptions(generationConfig: zero).temperature == 1)  // only false itself means greedy
    let bad = try JSONSerialization.jsonObject(with: Data(#"{"top_p": 1.5}"#.utf8)) as! [String: Any]
    #expect(throws: GemmaANEError(.bundle, "hf_model/generation_config.json: top_p=1.5: must be <= 1.0")) {
        try SamplingOptions(generationConfig: bad, file: "hf_model/generation_config.json")
    }
    let text = try JSONSerialization.jsonObject(with: Data(#"{"top_k": true}"#.utf8)) as! [String: Any]
    #expect(throws: GemmaANEError.self) { try SamplingOptions(generationConfig: text) }
}

@Test func samplingWithNothingToDrawIsAnErrorNotATrap() throws {
    var banned = try Sampler(options: SamplingOptions(seed: 1), bans: [0, 1, 2])
    #expect(throws: GemmaANEError.self) { try banned.sample([1, 2, 3]) }
    var broken = try Sampler(options: SamplingOptions(topP: 0.5, seed: 1))
    #expect(throws: GemmaANEError.self) { try broken.sample([.nan, .nan, .nan]) }
    var empty = try Sampler(options: SamplingOptions(temperature: 0))
    #expect(throws: GemmaANEError.self) { try empty.sample([Float]()) }
}

@Test(arguments: [
    SamplingOptions(seed: 1), SamplingOptions(topK: 2, seed: 1), SamplingOptions(topP: 0.5, seed: 1),
    SamplingOptions(minP: 0.1, seed: 1), SamplingOptions(temperature: 0.5, topK: 2, topP: 0.9, minP: 0.1, seed: 1),
])
func samplingLogitsThatAreNotNumbersAreAnError(_ options: SamplingOptions) throws {
    var sampler = try Sampler(options: options)
    #expect(throws: GemmaANEError.self) { try sampler.sample([Float](repeating: .nan, count: 20_000)) }
    #expect(throws: GemmaANEError.self) { try sampler.sample([Float](repeating: -.infinity, count: 5)) }
}
