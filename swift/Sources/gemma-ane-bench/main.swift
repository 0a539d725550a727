// The Swift host work that bench/swift_host.py times (it builds this in release and prints ratios against the
// Python runtime on the same inputs). Each mode prints one JSON object of timings in milliseconds.
//
//   gemma-ane-bench tokenizer TOKENIZER_JSON REPEATS
//   gemma-ane-bench sampler LOGITS_F32 VOCAB STEPS TEMPERATURE TOP_K TOP_P MIN_P REPETITION PRESENCE FREQUENCY
//   gemma-ane-bench host ROOT LOGITS_F32 VOCAB STEPS TEMPERATURE TOP_K TOP_P MIN_P REPETITION PRESENCE FREQUENCY
//     (per token as the engine does it: the token's embedding and PLE rows read and dequantised, the RoPE rows
//     and masks of its position, then the draw; ROOT holds model_config.json and the sidecars)
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
        var loads = [Double](), cpu = [Double]()
        var tokenizer: BPETokenizer?
        for _ in 0..<(Int(args[3]) ?? 1) {
            // the process's CPU time too: on a machine shared with other jobs, wall time measures the queue
            let start = clock()
            loads.append(try milliseconds { tokenizer = try BPETokenizer(contentsOf: url) })
            cpu.append(Double(clock() - start) * 1000 / Double(CLOCKS_PER_SEC))
        }
        let text = String(repeating: "The capital of France is Paris. 中文 😀 ", count: 100)
        var ids = [Int]()
        let encode = milliseconds { ids = tokenizer!.encode(text) }
        emit(["load_ms": loads, "load_cpu_ms": cpu, "encode_ms": encode, "encoded_tokens": ids.count, "vocab": tokenizer!.vocabularySize])
    case "sampler" where args.count == 12, "host" where args.count == 13:
        let host = args[1] == "host"
        let a = host ? Array(args.dropFirst()) : args  // the sampler's arguments at the same places
        let vocab = Int(a[3])!, steps = Int(a[4])!
        let numbers = a[5...].map { Double($0)! }
        let options = SamplingOptions(
            temperature: numbers[0], topK: Int(numbers[1]), topP: numbers[2], minP: numbers[3],
            repetitionPenalty: numbers[4], presencePenalty: numbers[5], frequencyPenalty: numbers[6], seed: 7)
        let data = try Data(contentsOf: URL(fileURLWithPath: a[2]))
        let rows = data.withUnsafeBytes { Array($0.bindMemory(to: Float.self)) }
        guard rows.count >= vocab, rows.count % vocab == 0 else { fail("\(a[2]): not rows of \(vocab) floats") }
        var tables: HostTables?, config: ModelConfig?
        if host {
            let root = URL(fileURLWithPath: args[2])
            let file = root.appendingPathComponent("model_config.json")
            let json = try JSONDecoder().decode([String: BundleJSON].self, from: Data(contentsOf: file))
            config = try ModelConfig(json: json, file: file.path)
            tables = try HostTables(root: root, config: config!)
        }
        // a history of 1,000 tokens for the penalties, as a long chat has
        var sampler = try Sampler(options: options, history: (0..<1000).map { ($0 * 7919) % vocab })
        var times = [Double](), tokens = [Int]()
        let count = rows.count / vocab
        var token = 2
        for step in 0..<steps {
            let row = step % count
            times.append(
                try milliseconds {
                    if let tables, let config {
                        let context = config.contextLength ?? 2048, window = config.slidingWindow ?? 512
                        let p = 1000 + step % (context - 1000)
                        let (hidden, ple) = try tables.embed([token])
                        let sliding = tables.ropeRows("sliding_attention", p0: p, count: 1)
                        let full = tables.ropeRows("full_attention", p0: p, count: 1)
                        let masks = (Masks.full(p0: p, count: 1, context: context), Masks.sliding(p0: p, count: 1, window: window, ring: window))
                        guard hidden.count == config.hiddenSize, !ple.isEmpty, sliding != nil, full != nil, !masks.0.isEmpty else {
                            fail("the host rows are not of the config's shapes")
                        }
                    }
                    token = try rows[(row * vocab)..<((row + 1) * vocab)].withUnsafeBufferPointer { try sampler.sample($0) }
                    sampler.observe(token)
                })
            tokens.append(token)
        }
        emit(["token_ms": times, "tokens": tokens])
    default:
        fail("usage: gemma-ane-bench tokenizer TOKENIZER_JSON REPEATS | sampler LOGITS_F32 VOCAB STEPS T K P MINP REP PRES FREQ"
            + " | host ROOT LOGITS_F32 VOCAB STEPS T K P MINP REP PRES FREQ")
    }
} catch {
    fail("\(error)")
}
