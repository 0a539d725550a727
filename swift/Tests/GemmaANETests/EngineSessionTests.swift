import Foundation
import Testing
@testable import GemmaANE

/// tests/swift_goldens_engine.py's stub chunks: chunk_1 writes each row's hidden_states[0, t, 0] into its ring slot
/// and full-cache slot, chunk_2 returns zero logits; what the engine reuses and restores shows in the ring.
final class StubRunner: ChunkRunner {
    final class State: ChunkState {
        var arrays: [String: [Float]]
        /// The function that made it (a ladder's rungs size their states apart).
        let function: String
        init(_ arrays: [String: [Float]], function: String) {
            self.arrays = arrays
            self.function = function
        }
    }

    let name: String
    let functionNames: [String]
    let interfaces: [String: FunctionInterface]
    let stateful: Bool
    var loads: [String] = []
    var released: [String] = []
    /// Functions this device refuses to load (the fallback path).
    var refuses: Set<String> = []
    /// Called before each prediction (a test holds a generation there).
    var beforePredict: (() -> Void)?

    init(name: String, stateful: Bool, context: Int, ring: Int, batch: Int?, kv: [Int], verify: Int?, hidden: Int, ple: Int, vocab: Int,
         rungs: [Int] = []) {
        self.name = name
        self.stateful = stateful
        // `rungs`: a context ladder's smaller contexts, each carrying ctx{C}_infer (CONTRACT §3a)
        func io(_ T: Int, _ maskWidth: Int, _ pleWidth: Int, context: Int = context) -> FunctionInterface {
            let states = stateful
                ? [TensorSpec(name: "kv_cache_sliding", shape: [2, 1, ring, 4], dtype: .float16),
                   TensorSpec(name: "kv_cache_full", shape: [2, 1, context, 4], dtype: .float16)] : []
            var inputs = [TensorSpec(name: "hidden_states", shape: [1, T, hidden], dtype: .float16),
                          TensorSpec(name: "causal_mask_full", shape: [1, 1, T, context], dtype: .float16)]
            let outputs: [TensorSpec]
            if stateful {
                inputs += [TensorSpec(name: "per_layer_raw", shape: [1, T, pleWidth], dtype: .float16),
                           TensorSpec(name: "causal_mask_sliding", shape: [1, 1, T, maskWidth], dtype: .float16),
                           TensorSpec(name: "current_pos", shape: [1], dtype: .int32),
                           TensorSpec(name: "ring_pos", shape: [1], dtype: .int32)]
                outputs = [TensorSpec(name: "hidden_states_out", shape: [1, T, hidden], dtype: .float16),
                           TensorSpec(name: "per_layer_combined_out", shape: [1, T, pleWidth], dtype: .float16)]
            } else {
                inputs.append(TensorSpec(name: "per_layer_combined", shape: [1, T, ple], dtype: .float16))
                outputs = [TensorSpec(name: "logits", shape: [1, 1, vocab], dtype: .float16)]
            }
            return FunctionInterface(inputs: inputs, outputs: outputs, states: states)
        }
        var interfaces: [String: FunctionInterface] = [:], names: [String] = []
        for c in [context] + rungs {
            let prefix = c == context ? "" : "ctx\(c)_"  // the top rung under the plain names
            func add(_ function: String, _ f: FunctionInterface) {
                interfaces[prefix + function] = f
                names.append(prefix + function)
            }
            add("infer", io(1, ring, ple, context: c))
            if stateful, let batch { add("prefill_b\(batch)", io(batch, ring, ple, context: c)) }
            for T in stateful ? kv : [] { add("prefill_kv_b\(T)", io(T, ring + T, 8, context: c)) }
            if let verify { add("verify_b\(verify)", io(verify, ring, ple, context: c)) }
        }
        self.interfaces = interfaces
        functionNames = names
    }

    func load(_ function: String) throws {
        if refuses.contains(function) { throw GemmaANEError(.functionUnavailable, "\(name): function '\(function)' cannot be loaded") }
        loads.append(function)
    }

    func release(_ functions: [String]) { released += functions }

    func makeState(_ function: String) throws -> ChunkState? {
        guard stateful, let io = interfaces[function] else { return nil }
        return State(
            Dictionary(uniqueKeysWithValues: io.states.map { ($0.name, [Float](repeating: 0, count: $0.shape.reduce(1, *))) }), function: function)
    }

    func predict(_ function: String, inputs: [String: Tensor], state: ChunkState?) throws -> [String: Tensor] {
        beforePredict?()
        let io = try #require(interfaces[function])
        for spec in io.inputs {
            let t = try #require(inputs[spec.name], "\(name).\(function): \(spec.name) missing")
            #expect(t.shape == spec.shape && t.dtype == spec.dtype, "\(name).\(function): \(spec.name) \(t.shape)")
        }
        guard stateful, let s = state as? State else {
            let spec = io.outputs[0]
            return ["logits": Tensor(floats: [Float](repeating: 0, count: spec.shape.reduce(1, *)), shape: spec.shape, dtype: .float16)]
        }
        let h = try #require(inputs["hidden_states"]), hidden = h.shape[2]
        let p0 = Int(try #require(inputs["current_pos"]).floats[0])
        let ring = try #require(interfaces[s.function]?.states[0].shape[2]), values = h.floats
        for t in 0..<h.shape[1] {
            s.arrays["kv_cache_sliding"]?[(p0 + t) % ring * 4] = values[t * hidden]
            s.arrays["kv_cache_full"]?[(p0 + t) * 4] = values[t * hidden]
        }
        return ["hidden_states_out": h, "per_layer_combined_out": try #require(inputs["per_layer_raw"])]
    }

    func readState(_ state: ChunkState, name: String) throws -> Tensor {
        let s = try #require(state as? State), spec = try #require(interfaces[s.function]?.states.first { $0.name == name })
        return Tensor(floats: s.arrays[name] ?? [], shape: spec.shape, dtype: spec.dtype)
    }

    func writeState(_ state: ChunkState, name: String, _ tensor: Tensor) throws {
        try #require(state as? State).arrays[name] = tensor.floats
    }
}

/// An engine over a stub bundle (stubBundle).
func stubEngine(_ g: [BundleJSON], refuse: Set<String> = [], warnings: @escaping (String) -> Void = { _ in }) throws -> (Engine, [StubRunner]) {
    let rungs = g.count > 6 ? (g[6].array ?? []).compactMap(\.int) : []
    let (bundle, runners) = try stubBundle(g, refuse: refuse, rungs: rungs)
    return (try Engine(bundle: bundle, runners: runners, warn: warnings), runners)
}

/// A bundle over the goldens' host tables and tokenizer with the given geometry
/// ([context, window, ring, prefill batch, [kv batches], verify batch, and a ladder's smaller rungs if any]); its
/// chunks are stubs.
func stubBundle(_ g: [BundleJSON], refuse: Set<String> = [], rungs: [Int] = []) throws -> (ModelBundle, [StubRunner]) {
    let root = try EngineGoldens.dir().appendingPathComponent("host")
    let bundleURL = FileManager.default.temporaryDirectory.appendingPathComponent("gemma-ane-stub-\(UUID().uuidString)")
    try FileManager.default.copyItem(at: root, to: bundleURL)
    for i in 1...2 { try FileManager.default.createDirectory(at: bundleURL.appendingPathComponent("chunk_\(i).mlpackage"), withIntermediateDirectories: true) }
    // the goldens' config states three chunks implicitly; these stubs are two
    var config = try readJSONObject(bundleURL.appendingPathComponent("model_config.json"))
    config["chunks"] = .array([.object(["name": .string("chunk_1")]), .object(["name": .string("chunk_2")])])
    config["sliding_window"] = .int(g[1].int ?? 0)
    let data = try JSONSerialization.data(withJSONObject: config.mapValues(\.any))
    try data.write(to: bundleURL.appendingPathComponent("model_config.json"))
    let bundle = try ModelBundle(bundleURL)
    let (context, ring) = (g[0].int ?? 0, g[2].int ?? 0)
    let kv = (g[4].array ?? []).compactMap(\.int), verify = g[5].int
    let h = bundle.config.hiddenSize, ple = bundle.config.numHiddenLayers * bundle.config.perLayerDim
    let runners = [
        StubRunner(name: "chunk_1", stateful: true, context: context, ring: ring, batch: g[3].int, kv: kv, verify: verify, hidden: h, ple: ple, vocab: bundle.config.vocabSize, rungs: rungs),
        StubRunner(name: "chunk_2", stateful: false, context: context, ring: ring, batch: g[3].int, kv: kv, verify: verify, hidden: h, ple: ple, vocab: bundle.config.vocabSize, rungs: rungs),
    ]
    runners[0].refuses = refuse
    return (bundle, runners)
}

@Test func engineReusesAsPythonDoes() throws {
    let sessions = try EngineGoldens.json()["sessions"]?.array ?? []
    #expect(sessions.count >= 4)
    for (n, session) in sessions.enumerated() {
        let s = try #require(session.object)
        let (engine, runners) = try stubEngine(s["geometry"]?.array ?? [])
        for (op, after) in zip(s["ops"]?.array ?? [], s["after"]?.array ?? []) {
            let o = try #require(op.array), a = try #require(after.object)
            let ids = (o[1].array ?? []).compactMap(\.int)
            if o[0].string == "prompt" {
                let (reused, _) = try engine.prompt(ids, marks: (o[2].array ?? []).compactMap(\.int))
                #expect(reused == a["reused"]?.int, "session \(n)")
            } else {
                for t in ids { try engine.feed([t]) }
            }
            #expect(engine.position == a["position"]?.int, "session \(n)")
            #expect(engine.ringTop == a["ring_top"]?.int, "session \(n)")
            let history = (a["history"]?.array ?? []).map { "\($0.array?[0].int ?? 0):\($0.array?[1].string ?? ""):\($0.array?[2].int ?? 0)" }
            #expect(engine.history.map { "\($0.position):\($0.function):\($0.count)" } == history, "session \(n)")
            let ring = try runners[0].readState(try #require(engine.states[0]), name: Engine.ringState).floats
            let slots = engine.paths.ring  // layer 0's K, first column: one value a slot
            #expect((0..<slots).map { ring[$0 * 4] } == floats(a["ring"]), "session \(n)")
            // the context ladder: the rung run, every climb, and the full caches' written prefix carried up
            #expect(engine.rung == a["rung"]?.int, "session \(n)")
            let climbs = (a["crossings"]?.array ?? []).map { ($0.array ?? []).compactMap(\.int) }
            #expect(engine.crossings.map { [$0.before, $0.after, $0.position] } == climbs, "session \(n)")
            let full = try runners[0].readState(try #require(engine.states[0]), name: "kv_cache_full").floats
            #expect((0..<engine.position).map { full[$0 * 4] } == floats(a["full"]), "session \(n)")
        }
    }
}

@Test func engineFallsBackFromARefusedPromptFunctionWithOneWarning() throws {
    let geometry: [BundleJSON] = [.int(64), .int(16), .int(16), .int(4), .array([.int(8), .int(4)]), .null]
    var warned: [String] = []
    let (engine, runners) = try stubEngine(geometry, refuse: ["prefill_kv_b8", "prefill_kv_b4"]) { warned.append($0) }
    _ = try engine.prompt(Array(repeating: 5, count: 20))
    #expect(Set(engine.history.map(\.function)) == ["prefill_b4", "infer"])
    #expect(warned.count == 2 && warned.allSatisfy { $0.contains("prompts run without it") })
    #expect(!runners[0].loads.contains("prefill_kv_b8"))
    _ = try engine.prompt(Array(repeating: 6, count: 20))
    #expect(warned.count == 2)  // said once
}

@Test func engineCancelledPromptKeepsTheBatchesRun() throws {
    let geometry: [BundleJSON] = [.int(64), .int(16), .int(16), .int(4), .array([]), .null]
    let (engine, _) = try stubEngine(geometry)
    var asked = 0
    #expect(throws: GemmaANEError(.cancelled, "cancelled after 8 of the prompt's tokens")) {
        try engine.prompt(Array(2..<22), cancelled: { asked += 1; return asked > 2 })
    }
    #expect(engine.position == 8 && engine.tokens == Array(2..<10))
    #expect(throws: GemmaANEError.self) { try engine.prompt(Array(repeating: 3, count: 65)) }
}
