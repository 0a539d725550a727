// The Swift host work that bench/swift_host.py times (it builds this in release and prints ratios against the
// Python runtime on the same inputs). Each mode prints one JSON object of timings in milliseconds.
//
//   gemma-ane-bench tokenizer TOKENIZER_JSON REPEATS
//   gemma-ane-bench sampler LOGITS_F32 VOCAB STEPS TEMPERATURE TOP_K TOP_P MIN_P REPETITION PRESENCE FREQUENCY
import Foundation
import GemmaANE

func milliseconds(_ work: () throws -> Void) rethrows -> Double {
    let start = DispatchTime.now().uptimeNanoseconds
    try work()
    return Double(DispatchTime.now().uptimeNanoseconds - start) / 1e6
}

func emit(_ object: [String: Any]) {
    let data = try! JSONSerialization.data(withJSONObject: object, options: [.sortedKeys])
    print(String(decoding: data, as: UTF8.self))
}

func fail(_ message: String) -> Never {
    FileHandle.standardError.write(Data("gemma-ane-bench: \(message)\n".utf8))
    exit(2)
}

let args = CommandLine.arguments
do {
    switch args.count > 1 ? args[1] : "" {
    case "tokenizer" where args.count == 4:
        let url = URL(fileURLWithPath: args[2])
        var loads = [Double]()
        var tokenizer: BPETokenizer?
        for _ in 0..<(Int(args[3]) ?? 1) {
            loads.append(try milliseconds { tokenizer = try BPETokenizer(contentsOf: url) })
        }
        let text = String(repeating: "The capital of France is Paris. 中文 😀 ", count: 100)
        var ids = [Int]()
        let encode = milliseconds { ids = tokenizer!.encode(text) }
        emit(["load_ms": loads, "encode_ms": encode, "encoded_tokens": ids.count, "vocab": tokenizer!.vocabularySize])
    case "sampler" where args.count == 12:
        let vocab = Int(args[3])!, steps = Int(args[4])!
        let numbers = args[5...].map { Double($0)! }
        let options = SamplingOptions(
            temperature: numbers[0], topK: Int(numbers[1]), topP: numbers[2], minP: numbers[3],
            repetitionPenalty: numbers[4], presencePenalty: numbers[5], frequencyPenalty: numbers[6], seed: 7)
        let data = try Data(contentsOf: URL(fileURLWithPath: args[2]))
        let rows = data.withUnsafeBytes { Array($0.bindMemory(to: Float.self)) }
        guard rows.count >= vocab, rows.count % vocab == 0 else { fail("\(args[2]): not rows of \(vocab) floats") }
        // a history of 1,000 tokens for the penalties, as a long chat has
        var sampler = try Sampler(options: options, history: (0..<1000).map { ($0 * 7919) % vocab })
        var times = [Double](), tokens = [Int]()
        let count = rows.count / vocab
        for step in 0..<steps {
            let row = step % count
            var token = 0
            times.append(
                try milliseconds {
                    token = try rows[(row * vocab)..<((row + 1) * vocab)].withUnsafeBufferPointer { try sampler.sample($0) }
                    sampler.observe(token)
                })
            tokens.append(token)
        }
        emit(["token_ms": times, "tokens": tokens])
    default:
        fail("usage: gemma-ane-bench tokenizer TOKENIZER_JSON REPEATS | sampler LOGITS_F32 VOCAB STEPS T K P MINP REP PRES FREQ")
    }
} catch {
    fail("\(error)")
}
