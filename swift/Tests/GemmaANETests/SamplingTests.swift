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
